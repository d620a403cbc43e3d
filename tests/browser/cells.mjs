// The one comparison every page check uses to compare numbers it read from a page with the
// numbers the Rust test computed (the browser side of tests/common's `assert_cells`):
//   assertCells(label, got, want, tol, fail)
// `got` and `want` are arrays (cells keyed by index) or plain objects / Maps (keyed by name). It
// fails (calls `fail(message)`, default: throws) when an expected cell is missing or one is not
// expected, when a value on either side is not a finite number (`+undefined`, a NaN, an infinity,
// an empty DOM attribute), or when the worst |got - want| is over `tol`; the message names the
// label, the cell and both values. It returns the worst difference.
//
// `num(x)` reads a page's number strictly: a number, or a string holding one; anything else
// (undefined, null, "", "abc") is NaN, which `assertCells` then refuses (`+""` would be 0).

export function num(x) {
  if (typeof x === "number") return x;
  if (typeof x === "string" && x.trim() !== "") return Number(x);
  return NaN;
}

function entries(label, side, v) {
  if (Array.isArray(v) || ArrayBuffer.isView(v)) return Array.from(v, (x, i) => [String(i), x]);
  if (v instanceof Map) return [...v].map(([k, x]) => [String(k), x]);
  if (v !== null && typeof v === "object") return Object.entries(v);
  throw new Error(`${label}: ${side} is not an array or an object of cells: ${v}`);
}

const throwIt = (msg) => { throw new Error(msg); };

export function assertCells(label, got, want, tol, fail = throwIt) {
  if (!(tol >= 0)) return fail(`${label}: the bound ${tol} is not a number >= 0`);
  const expected = new Map();
  for (const [k, w] of entries(label, "the reference", want)) {
    if (typeof w !== "number" || !Number.isFinite(w)) return fail(`${label}: the reference's cell ${k} is ${w}`);
    expected.set(k, w);
  }
  if (expected.size === 0) return fail(`${label}: the reference has no cells`);
  const seen = new Set();
  let worst = 0, at = null;
  for (const [k, g] of entries(label, "the page", got)) {
    if (typeof g !== "number" || !Number.isFinite(g)) return fail(`${label}: cell ${k} is ${g}`);
    if (!expected.has(k)) return fail(`${label}: cell ${k} (= ${g}) is not in the reference`);
    seen.add(k);
    const d = Math.abs(g - expected.get(k));
    if (at === null || d > worst) { worst = d; at = k; }
  }
  const missing = [...expected.keys()].filter((k) => !seen.has(k));
  if (missing.length) return fail(`${label}: ${missing.length} of ${expected.size} reference cells missing, first ${missing[0]}`);
  if (worst > tol) return fail(`${label}: max |difference| ${worst} > ${tol} at cell ${at} (got ${entries(label, "", got).find(([k]) => k === at)[1]}, want ${expected.get(at)})`);
  return worst;
}
