// MathJax 3 configuration; this file must load before the vendored MathJax script.
//
// Math reaches the page in two forms:
//  - Markdown pages: pymdownx.arithmatex (generic mode) wraps it in `.arithmatex` elements
//    with \( \) and \[ \] delimiters.
//  - Notebook pages: nbconvert leaves markdown-cell math as raw $...$ / $$...$$ text inside
//    `.jp-RenderedMarkdown` (and LaTeX outputs inside `.jp-RenderedLatex`).
//  - The page's table of contents (`.md-nav--secondary`) repeats headings, math included.
// Typesetting only those elements lets us accept $ delimiters for notebooks without
// turning a stray "$" elsewhere on the site (prose, site navigation) into math.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,      // \$ is a literal dollar
    processEnvironments: true, // \begin{align} ... without $$ around it
    tags: "ams",
  },
  startup: {
    elements: [".arithmatex", ".jp-RenderedMarkdown", ".jp-RenderedLatex", ".md-nav--secondary"],
  },
};
