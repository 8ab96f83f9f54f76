"""The docs site, built and opened in a real (headless) browser.

A strict `mkdocs build` only proves that the Markdown compiled. What readers see depends on
JavaScript running in their browser: MathJax typesetting the math, the notebook plots
decoding. So this test builds the site into a temp dir, serves it on 127.0.0.1 and opens
every page in Debian's chromium, checking that

- the page loads, with no SEVERE entry in the browser console (a failed script or font
  fetch, e.g. from a CDN an offline reader cannot reach, shows up there);
- math is typeset: no raw TeX delimiters are left in the article, MathJax reported no TeX
  error, and a page whose HTML contains TeX has MathJax output (`mjx-container`);
- every <img> decoded (naturalWidth > 0): notebook figures are embedded PNGs; each one in
  the article is wrapped for the lightbox (click-to-zoom), and a notebook figure takes the
  width of the text column (or its own, if smaller);
- every link of the table of contents (and of the rest of the navigation) that points into
  the page (`#id`) finds an element with that id;
- a chapter page offers its notebook for download, and the link serves a valid notebook.

Two more tests use the browser: a figure opens in the lightbox on a click, and the search box
finds chapters for prose terms, with no code cell ("In [1]:", the copy button's "Copied!") in
the results. All reuse the one site build.

It also saves screenshots of the home page and Chapter 1 to build/screenshots/ (look at
them!) and checks that they are not blank.

Needs chromium and chromedriver (`scripts/install-browser.sh`). Without them the test is
skipped, except under CI=true, where a missing browser is a failure.
"""
from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "build" / "screenshots"
CHROMEDRIVER = "/usr/bin/chromedriver"  # Debian's chromium-driver; never selenium-manager


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser_binary() -> str:
    """Chromium's path, checked before the (slow) site build."""
    chromium = _chromium()
    if chromium and os.access(CHROMEDRIVER, os.X_OK):
        return chromium
    msg = (f"chromium ({chromium or 'not found'}) and {CHROMEDRIVER} are needed for the "
           "browser test: run scripts/install-browser.sh")
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"CI is set and the browser is missing. {msg}")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def site_dir(browser_binary, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.fixture(scope="module")
def base_url(site_dir):
    """Serve the built site over http (file:// would change how scripts and fonts load)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest's output clean
            pass

    handler = functools.partial(Quiet, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # port 0: a free one
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def driver(browser_binary):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser_binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--hide-scrollbars"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: selenium skips selenium-manager, which would try to download.
    drv = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    drv.set_page_load_timeout(60)
    drv.set_script_timeout(60)
    yield drv
    drv.quit()


def _pages(site_dir: Path) -> list[str]:
    return sorted(p.relative_to(site_dir).as_posix() for p in site_dir.rglob("*.html"))


def _stored_figures(site_dir: Path, page: str) -> int:
    """How many PNG/JPEG outputs the notebook behind a page stores (0 for a Markdown page).

    mkdocs-jupyter (`include_source: true`) copies `chapters/NAME.ipynb` next to its page,
    `chapters/NAME/index.html`; reading that copy rather than chapters/ keeps the count in
    step with what was built even if someone re-saves the notebook meanwhile.
    """
    nb = site_dir / Path(page).parent / f"{Path(page).parent.name}.ipynb"
    if not nb.is_file():
        return 0
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    return sum(1 for c in cells for o in c.get("outputs", [])
               if {"image/png", "image/jpeg"} & set(o.get("data", {})))


def _has_tex(html: str) -> bool:
    """Whether the built HTML (before any JavaScript runs) contains math to typeset."""
    text = re.sub(r"(?s)<(script|style|pre|code)\b.*?</\1>", "", html)
    # mkdocs-jupyter keeps each code cell's source in a hidden div for its copy button.
    text = re.sub(r'(?s)<div class="clipboard-copy-txt".*?</div>', "", text)
    return bool(re.search(r"\\\(|\\\[|\$\$|\$[^$\s<][^$<]*\$", text))


# Visible text left once MathJax is done: raw TeX means math that was not typeset.
RAW_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$|\$[^$\s][^$\n]*[^$\s\\]\$")

# Resolves when the page, MathJax and every image are done. Returns what the checks need.
INSPECT_JS = """
const done = arguments[arguments.length - 1];
(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  const imgs = Array.from(document.images);
  imgs.forEach(i => { i.loading = "eager"; });
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  // The visible text of the page body (article and the sidebars with its table of
  // contents): text nodes that are rendered, outside code and typeset math.
  const main = document.querySelector(".md-main") || document.body;
  const walker = document.createTreeWalker(main, NodeFilter.SHOW_TEXT);
  const text = [];
  while (walker.nextNode()) {
    const el = walker.currentNode.parentElement;
    if (el.closest("pre, code, script, style, mjx-container") || !el.getClientRects().length) {
      continue;
    }
    text.push(walker.currentNode.textContent);
  }
  // Links into the page itself: the table of contents (Material renders it twice, in the
  // right sidebar and, for small screens, in the navigation).
  const anchors = Array.from(document.querySelectorAll("a.md-nav__link[href^='#']"))
    .map(a => a.getAttribute("href"));
  const articleImgs = Array.from(document.querySelectorAll(".md-content img"));
  return {
    title: document.title,
    tocLinks: anchors.length,
    badAnchors: anchors.filter(h => !document.getElementById(decodeURIComponent(h.slice(1)))),
    downloads: Array.from(document.querySelectorAll(".md-content a[download]")).map(a => a.getAttribute("href")),
    notZoomable: articleImgs.filter(i => !i.closest("a.glightbox")).map(i => i.src.slice(0, 100)),
    // Notebook figures drawn narrower than the text column (or than themselves, if smaller).
    narrowFigures: Array.from(document.querySelectorAll(".jp-RenderedImage img")).filter(i => {
      const column = document.querySelector(".md-content__inner").clientWidth;
      return i.getBoundingClientRect().width < 0.9 * Math.min(i.naturalWidth, column);
    }).map(i => `${Math.round(i.getBoundingClientRect().width)}px of ${i.naturalWidth}px`),
    hasArticle: !!document.querySelector("article"),
    mathjax: !!(window.MathJax && MathJax.startup && MathJax.startup.document),
    mjx: document.querySelectorAll("mjx-container").length,
    mjxErrors: Array.from(document.querySelectorAll("mjx-merror")).map(e => e.textContent),
    images: imgs.length,
    badImages: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 100)),
    text: text.join(""),
  };
})().then(done, err => done({error: String(err)}));
"""


def _open(driver, url: str) -> dict:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get_log("browser")  # drop entries left over from the previous page
    driver.get(url)
    # get() can return while the new document is still parsing (seen with chromedriver
    # under load), before MathJax's script has even run: wait for the load event.
    WebDriverWait(driver, 60).until(
        lambda d: d.execute_script("return document.readyState") == "complete")
    info = driver.execute_async_script(INSPECT_JS)
    info["severe"] = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    return info


def _download_problems(site_dir: Path, base_url: str, page: str, hrefs: list[str]) -> list[str]:
    """What is wrong with a chapter page's "download this notebook" link (nothing: [])."""
    import nbformat

    notebooks = [h for h in hrefs if h.split("?")[0].endswith(".ipynb")]
    if len(notebooks) != 1:
        return [f"expected one download link to the .ipynb, found {hrefs}"]
    href = notebooks[0]
    target = (site_dir / Path(page).parent / href).resolve()
    if not target.is_relative_to(site_dir.resolve()) or not target.is_file():
        return [f"download link {href!r}: no such file in the built site"]
    # Served as a reader's browser would fetch it, and a notebook nbformat accepts.
    with urllib.request.urlopen(base_url + target.relative_to(site_dir.resolve()).as_posix(),
                                timeout=30) as response:
        served = response.read()
    if served != target.read_bytes():
        return [f"download link {href!r}: the server sent other bytes than the built file"]
    try:
        nb = nbformat.reads(served.decode("utf-8"), as_version=4)
        nbformat.validate(nb)
    except Exception as exc:  # json.JSONDecodeError, nbformat.ValidationError, ...
        return [f"download link {href!r}: not a valid notebook: {exc!s:.200}"]
    if target.name != f"{Path(page).parent.name}.ipynb":  # chapters/NAME/ offers NAME.ipynb
        return [f"download link {href!r}: the notebook of another page"]
    return []


def test_every_page_renders(site_dir, base_url, driver):
    pages = _pages(site_dir)
    assert "index.html" in pages and "chapters/01_naive_attention/index.html" in pages, pages
    problems = []
    chapters = 0
    for page in pages:
        info = _open(driver, base_url + page)
        if "error" in info:
            problems.append(f"{page}: inspection script failed: {info['error']}")
            continue
        bad = []
        if not info["hasArticle"]:
            bad.append(f"no <article>: not a site page (title {info['title']!r})")
        bad += [f"console: {m}" for m in info["severe"]]
        if _has_tex((site_dir / page).read_text(encoding="utf-8")):
            if not info["mathjax"]:
                bad.append("has math but MathJax did not start")
            elif info["mjx"] == 0:
                bad.append("has math but no mjx-container was rendered")
        bad += [f"TeX error: {e}" for e in info["mjxErrors"]]
        raw = sorted({m.group(0)[:40] for m in RAW_TEX.finditer(info["text"])})
        if raw:
            bad.append(f"raw TeX left in the text: {raw[:5]}")
        bad += [f"image did not load: {src}" for src in info["badImages"]]
        figures = _stored_figures(site_dir, page)
        if info["images"] < figures:
            bad.append(f"{info['images']} <img> on the page, but the notebook stores {figures} figures")
        bad += [f"figure not wrapped for the lightbox: {src}" for src in info["notZoomable"]]
        bad += [f"figure narrower than the text column: {w}" for w in info["narrowFigures"]]
        bad += [f"TOC link to a missing id: {h}" for h in sorted(set(info["badAnchors"]))]
        if page.startswith("chapters/"):
            chapters += 1
            if not info["tocLinks"]:
                bad.append("no table of contents")
            bad += _download_problems(site_dir, base_url, page, info["downloads"])
        problems += [f"{page}: {b}" for b in bad]
    assert chapters >= 10, f"only {chapters} chapter pages were built"
    assert not problems, f"{len(problems)} problem(s) in {len(pages)} pages:\n" + "\n".join(problems)


def _not_blank(path: Path) -> tuple[bool, str]:
    from PIL import Image, ImageStat

    img = Image.open(path).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 24)
    n_colours = len(colours) if colours else 1 << 24
    std = sum(ImageStat.Stat(img.convert("L")).stddev)
    # A blank (or nearly blank) page has a handful of colours and a flat histogram; text,
    # anti-aliased math and a plot give hundreds of colours and a large spread.
    return n_colours >= 64 and std >= 10, f"{n_colours} colours, grey std {std:.1f}"


@pytest.mark.parametrize("page, name, needs_figure", [
    ("index.html", "home.png", False),
    ("chapters/01_naive_attention/index.html", "chapter1.png", True),
])
def test_screenshot(site_dir, base_url, driver, page, name, needs_figure):
    info = _open(driver, base_url + page)
    assert "error" not in info, info
    assert info["mjx"] > 0, f"{page}: expected typeset math on this page"
    if needs_figure:
        # The book ships its notebooks executed, plots included; a chapter without a stored
        # figure was saved unexecuted (or with its outputs cleared).
        assert _stored_figures(site_dir, page) > 0, (
            f"{page}: its notebook stores no figure; execute it and save it with its outputs")
        assert info["images"] > 0 and not info["badImages"], f"{page}: figures did not load"
    # Grow the window to the page (up to a limit) so the screenshot shows the text, the math
    # and the figures, not only what fits above the fold.
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, max(1000, min(height + 150, 6000)))
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    try:
        assert driver.save_screenshot(str(path)), f"could not save {path}"
    finally:
        driver.set_window_size(1280, 1000)
    ok, stats = _not_blank(path)
    assert ok, f"{path} looks blank ({stats})"


def test_figure_opens_in_lightbox(site_dir, base_url, driver):
    """Multi-panel figures are shrunk to the text column: a click shows one at full size."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    page = "chapters/01_naive_attention/index.html"
    info = _open(driver, base_url + page)
    assert "error" not in info and info["images"] > 0, info
    link = driver.find_element(By.CSS_SELECTOR, ".md-content a.glightbox")
    shown = driver.execute_script("return arguments[0].querySelector('img').clientWidth", link)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", link)
    link.click()
    # The slide's image, once it has loaded and the opening animation has ended (its width
    # the same twice in a row).
    widths = []

    def settled(d):
        widths.append(d.execute_script("""
            const img = document.querySelector(".glightbox-container .gslide.current .gslide-image img");
            return img && img.complete && img.naturalWidth > 0
                ? Math.round(img.getBoundingClientRect().width) : 0;"""))
        return widths[-1] if len(widths) > 1 and widths[-1] == widths[-2] > 0 else None

    big = WebDriverWait(driver, 30, poll_frequency=0.3).until(settled)
    assert big > shown, f"the lightbox shows the figure {big:.0f}px wide, the page {shown}px"
    driver.find_element(By.TAG_NAME, "body").send_keys(Keys.ESCAPE)
    WebDriverWait(driver, 30).until(
        lambda d: not d.find_elements(By.CSS_SELECTOR, ".glightbox-container"))
    severe = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe


# Terms of the chapters' prose, each also in the API pages' docstrings (which once ranked first).
SEARCH_TERMS = ["softmax", "prefix caching", "sliding window"]


def test_search_finds_prose(site_dir, base_url, driver):
    """The search box ranks the chapters first, and shows prose: never a code cell or output."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    info = _open(driver, base_url + "index.html")
    assert "error" not in info, info
    box = driver.find_element(By.CSS_SELECTOR, "input.md-search__input")
    problems = []
    for term in SEARCH_TERMS:
        driver.execute_script("arguments[0].focus()", box)
        box.clear()
        box.send_keys(term)
        # Material's search runs in a worker; its results replace the list as they come in.
        results = WebDriverWait(driver, 60).until(lambda d: d.execute_script("""
            const q = arguments[0];
            const items = Array.from(document.querySelectorAll(".md-search-result__item"));
            const links = Array.from(document.querySelectorAll(".md-search-result__item a"));
            // Wait for this term's results (their links carry it: ?h=term), not the last term's.
            if (!links.some(a => a.href.includes("h=" + q.split(" ")[0]))) {
              return null;
            }
            return items.map(item => ({
              href: new URL(item.querySelector("a").href).pathname,
              text: item.textContent.replace(/\\s+/g, " ")}));
            """, term))
        where = [r["href"] for r in results]
        if not where[0].lstrip("/").startswith("chapters/"):
            problems.append(f"{term!r}: the first result is {where[0]}, not a chapter ({where[:5]})")
        for r in results:
            for marker in ("Copied!", "In ["):
                if marker in r["text"]:
                    problems.append(f"{term!r}: a result from {r['href']} shows code: "
                                    f"...{r['text'][max(0, r['text'].index(marker) - 60):][:120]}...")
    assert not problems, "\n".join(problems)
