// hookscope docs: on a phone, every table reads as cards, one per row, each cell under its
// column's name (extra.css shows data-label before the cell below 45em). This script only copies
// each header's text onto the cells of its column; it runs on every page load (and on
// mkdocs-material's instant navigation, through document$, when that is on).
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
if (typeof document$ !== "undefined") {
  document$.subscribe(labelTableCells);
} else {
  document.addEventListener("DOMContentLoaded", labelTableCells);
}
