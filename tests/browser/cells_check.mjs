// The page checks' comparison (cells.mjs) fails where a plain `Math.abs(a - b) > tol` passes:
// node cells_check.mjs prints "ok" when every case below behaves, else exits 1 naming the case.
import { assertCells, num } from "./cells.mjs";

const bad = [];
const fails = (what, got, want, tol) => {
  let msg = null;
  try { assertCells(what, got, want, tol); } catch (e) { msg = e.message; }
  if (msg === null) bad.push(`${what}: passed, must fail`);
  return msg || "";
};
const passes = (what, got, want, tol) => {
  try { return assertCells(what, got, want, tol); } catch (e) { bad.push(`${what}: ${e.message}`); return NaN; }
};

if (!(Math.abs(passes("equal", [1, 2, 3], [1, 2.05, 3], 0.1) - 0.05) < 1e-12)) bad.push("equal: the worst difference");
passes("keyed", { a: 1, b: 2 }, new Map([["b", 2], ["a", 1]]), 0);
if (!fails("NaN", [1, NaN, 3], [1, 2, 3], 1e9).includes("cell 1 is NaN")) bad.push("NaN: the message names the cell");
fails("+undefined", [1, +undefined], [1, 2], 1e9);
fails("undefined", [1, undefined], [1, 2], 1e9);
fails("infinity", [1, Infinity], [1, 2], 1e9);
fails("a string", [1, "2"], [1, 2], 1e9);
fails("a reference NaN", [1, 2], [1, NaN], 1e9);
if (!fails("missing", [1, 2], [1, 2, 3], 1).includes("missing, first 2")) bad.push("missing: the message names the cell");
fails("extra", [1, 2, 3, 4], [1, 2, 3], 1);
fails("empty", [], [], 1);
if (!fails("over the bound", [1, 2.5], [1, 2], 0.1).includes("at cell 1")) bad.push("over: the message names the cell");
fails("a bound that is NaN", [1], [1], NaN);
if (!Number.isNaN(num("")) || !Number.isNaN(num(undefined)) || !Number.isNaN(num(null)) || !Number.isNaN(num("x"))) bad.push("num: an empty or absent value must be NaN");
if (num("0.25") !== 0.25 || num(3) !== 3) bad.push("num: a number");
if (bad.length) { console.error("FAIL: " + bad.join("\n")); process.exit(1); }
console.log("ok");
