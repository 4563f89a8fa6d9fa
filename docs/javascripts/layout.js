// hookscope docs layout helpers (issue 45): what CSS alone cannot do.
// 1. On a phone every table reads as cards, one per row, each cell under its column's name:
//    extra.css shows a cell's data-label above it below 45em; this copies each header's text
//    onto the cells of its column.
// 2. A code line that wraps continues 4 characters further in than the line's own indentation,
//    so a wrapped line never looks like a new statement or a dedent (each line is its own span:
//    mkdocs.yml, pymdownx.highlight line_spans; extra.css indents by 4 characters by default).
// It runs on every page load (and on mkdocs-material's instant navigation, through document$,
// when that is on).
function labelTableCells() {
  document.querySelectorAll(".md-typeset table:not([class])").forEach(function (table) {
    var names = Array.from(table.querySelectorAll("thead th")).map(function (th) {
      return th.textContent.trim();
    });
    table.querySelectorAll("tbody tr").forEach(function (row) {
      Array.from(row.children).forEach(function (cell, i) {
        if (names[i]) { cell.setAttribute("data-label", names[i]); }
      });
    });
  });
}
function hangWrappedLines() {
  document.querySelectorAll('.md-typeset pre > code > span[id^="__span"]').forEach(function (line) {
    var indent = line.textContent.match(/^ */)[0].length + 4;
    line.style.paddingLeft = indent + "ch";
    line.style.textIndent = -indent + "ch";
  });
}
function layout() { labelTableCells(); hangWrappedLines(); }
if (typeof document$ !== "undefined") {
  document$.subscribe(layout);
} else {
  document.addEventListener("DOMContentLoaded", layout);
}
