// Click-to-zoom for figures (mkdocs.yml: the glightbox plugin, in `manual` mode).
//
// The notebook figures are PNGs embedded in the page as data: URIs. The plugin would wrap
// each <img> in a link whose href repeats that URI, doubling the page's size, so it is set to
// wrap nothing on its own, and this script wraps the images instead, in the reader's browser:
// `<a class="glightbox" href="(the image's own src)">`. It runs from extra_javascript, before the
// plugin's `GLightbox(...)` call at the end of the page, which then finds the links.
(function () {
  "use strict";
  var SKIP = ["twemoji", "emojione", "gemoji", "off-glb"];
  document.querySelectorAll(".md-content img").forEach(function (img) {
    if (img.closest("a") || SKIP.some(function (c) { return img.classList.contains(c); })) {
      return;
    }
    var link = document.createElement("a");
    link.className = "glightbox";
    link.href = img.currentSrc || img.src;
    link.setAttribute("data-type", "image");
    link.setAttribute("data-width", "auto");
    link.setAttribute("data-height", "auto");
    link.setAttribute("aria-label", "Enlarge the figure");
    img.parentNode.insertBefore(link, img);
    link.appendChild(img);
  });
})();
