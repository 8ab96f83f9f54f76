"""MkDocs hooks for the book's notebook pages (mkdocs.yml, ``hooks:``).

mkdocs-jupyter renders each chapter notebook with nbconvert; three things about its pages are
fixed here, for every notebook page at once:

- **Table of contents.** mkdocs-jupyter builds the page's TOC from a Markdown export of the
  notebook, with Python-Markdown's slugs, while the headings in the page get their ids from
  nbconvert's renderer. The two disagree on headings with inline code (Markdown drops the
  code span: ``#the-oracle-transformers`` against ``id="the-oracle-transformers-generatenum_beamsk"``),
  leaving dead TOC links. The TOC is rebuilt here from the headings of the rendered Markdown
  cells, with their ids as the page has them.
- **Download link.** With ``include_source: true`` mkdocs-jupyter copies ``NAME.ipynb`` next to
  the page's ``index.html`` but shows no link to it (Material 9 has no template for it), so a
  download button is added at the top of the page.
- **Search.** Material's search indexes the whole page: code cells (with their prompts, "In [1]:",
  and the copy button's "Copied!") and outputs. And a heading inside a notebook cell ends its
  section when the cell's ``<div>`` closes, so the prose of later cells landed in one huge
  page-level entry. The search plugin is shown a flat copy of the page instead: the Markdown
  cells only, one after the other, so every heading's section holds the prose under it. The
  page itself is put back before the theme renders it. (On the API pages, likewise, the source
  code under each function is left out of the index: ``data-search-exclude``.)
"""
from __future__ import annotations

import html
import posixpath
import re
from html.parser import HTMLParser

from mkdocs.plugins import CombinedEvent, event_priority
from mkdocs.structure.toc import get_toc

# Material Design Icons' "download" (the theme's own icon set).
_DOWNLOAD_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" aria-hidden="true">'
                 '<path d="M5 20h14v-2H5m14-9h-4V3H9v6H5l7 7z"/></svg>')

_HEADING = re.compile(r"(?s)<h([1-6])\b([^>]*)>(.*?)</h\1\s*>")
_ID = re.compile(r"""\bid\s*=\s*(["'])(.*?)\1""")
_ANCHOR_LINK = re.compile(r'(?s)<a\b[^>]*class="anchor-link"[^>]*>.*?</a>')
_TAG_BUT_CODE = re.compile(r"</?(?!code\b)[a-zA-Z][^>]*>")


def _is_notebook(page) -> bool:
    return page.file.src_uri.endswith(".ipynb")


class _MarkdownCells(HTMLParser):
    """The inner HTML of each rendered Markdown cell of an nbconvert page, in order.

    Only ``<div>`` nesting is tracked (divs are never void, unlike ``<img>`` or ``<br>``):
    a cell is the ``jp-RenderedMarkdown`` div inside a ``jp-MarkdownCell`` div (Markdown
    *outputs* of code cells are ``jp-RenderedMarkdown`` too, but not in a Markdown cell).
    """

    def __init__(self, text: str):
        super().__init__(convert_charrefs=False)
        self.text = text
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
        self.stack: list[str] = []   # class attribute of each open div
        self.start: int | None = None  # offset where the current cell's content starts
        self.depth = 0                # len(self.stack) at the current cell's div
        self.cells: list[str] = []
        self.feed(text)
        self.close()

    def _offset(self) -> int:
        line, col = self.getpos()
        return self.line_starts[line - 1] + col

    def handle_starttag(self, tag, attrs):
        if tag != "div":
            return
        classes = (dict(attrs).get("class") or "").split()
        self.stack.append(" ".join(classes))
        if (self.start is None and "jp-RenderedMarkdown" in classes
                and any("jp-MarkdownCell" in c.split() for c in self.stack[:-1])):
            self.start = self._offset() + len(self.get_starttag_text())
            self.depth = len(self.stack)

    def handle_endtag(self, tag):
        if tag != "div" or not self.stack:
            return
        if self.start is not None and len(self.stack) == self.depth:
            self.cells.append(self.text[self.start:self._offset()])
            self.start = None
        self.stack.pop()


def _toc_from_headings(cells: list[str], toc_depth: int):
    """The page's TOC from the headings in its Markdown cells, with the ids they carry."""
    root: list[dict] = []
    open_tokens: list[dict] = []  # the last token at each level still open
    for cell in cells:
        for m in _HEADING.finditer(cell):
            level, attrs, inner = int(m.group(1)), m.group(2), m.group(3)
            found = _ID.search(attrs)
            if not found or level > toc_depth:
                continue
            name = _TAG_BUT_CODE.sub("", _ANCHOR_LINK.sub("", inner)).strip()
            token = {"level": level, "id": html.unescape(found.group(2)), "name": name, "children": []}
            while open_tokens and open_tokens[-1]["level"] >= level:
                open_tokens.pop()
            (open_tokens[-1]["children"] if open_tokens else root).append(token)
            open_tokens.append(token)
    return get_toc(root)


def _jupyter_config(config) -> dict:
    plugin = config.plugins.get("mkdocs-jupyter")
    return dict(plugin.config) if plugin is not None else {}


@event_priority(50)  # before other plugins (search, autorefs) read the page's TOC
def on_page_content(html_text: str, page, config, files) -> str:
    if not _is_notebook(page):
        # The API pages: the search indexes the docstrings, not the functions' source code.
        return html_text.replace('<details class="mkdocstrings-source"',
                                 '<details class="mkdocstrings-source" data-search-exclude')
    jupyter = _jupyter_config(config)
    cells = _MarkdownCells(html_text).cells
    toc = _toc_from_headings(cells, int(jupyter.get("toc_depth", 6)))
    if len(toc):
        page.toc = toc
    if jupyter.get("include_source"):
        # mkdocs-jupyter copies the notebook into the folder of the page's own HTML file.
        name = posixpath.basename(page.file.src_uri)
        title = "Download this chapter's notebook (.ipynb)"
        button = (f'<a href="{html.escape(name)}" download="{html.escape(name)}" title="{title}" '
                  f'aria-label="{title}" class="md-content__button md-icon minillm-download">'
                  f"{_DOWNLOAD_SVG}<span>.ipynb</span></a>")
        html_text = button + html_text
    return html_text


@event_priority(100)  # before the search plugin indexes the page
def _show_search_the_prose(context, page, config, nav):
    if _is_notebook(page):
        page.minillm_rendered_content = page.content
        page.content = "\n".join(_ANCHOR_LINK.sub("", cell) for cell in _MarkdownCells(page.content).cells)
    return context


@event_priority(-100)  # after it: the theme renders the real page
def _restore_page(context, page, config, nav):
    rendered = getattr(page, "minillm_rendered_content", None)
    if rendered is not None:
        page.content = rendered
        del page.minillm_rendered_content
    return context


on_page_context = CombinedEvent(_show_search_the_prose, _restore_page)
