#!/usr/bin/env bash
# Install the headless browser that tests/test_site.py drives: Debian's chromium and its
# matching chromedriver. Idempotent: does nothing when both are already on PATH.
#
# We use the distribution packages (not selenium-manager or a Chrome-for-Testing download)
# because they come from the package registry the CI and the test machines can reach, and
# apt keeps chromium and chromedriver at the same version.
set -euo pipefail

if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    echo "chromium and chromedriver are already installed: $(chromium --version 2>/dev/null || true)"
    exit 0
fi

# CI runs as root on a fresh Debian 12 machine; a developer's machine needs sudo.
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
PKGS=(chromium chromium-driver)

# Try without refreshing the package lists first (fast when they are recent); a fresh
# machine has no lists yet, so on failure update them once and try again.
if ! $SUDO apt-get install -y --no-install-recommends "${PKGS[@]}"; then
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends "${PKGS[@]}"
fi

echo "installed: $(chromium --version 2>/dev/null || true), $(chromedriver --version 2>/dev/null || true)"
