// Opens an `attnscope circuit --html` page in headless Chromium and drives it:
// node circuit.mjs <url> <expected.json> <screenshot.png>
// expected.json: {"n_edges", "kept", "sizes": [ladder edge counts], "faithfulness": [per size],
// "first": {"from", "to", "score", "exact"} (the largest edge),
// "head": {"name", "query", "key", "score", "sum", "gap", "n_terms", "terms"} (`attnscope qk --json`
// of the page's first clickable head, its query and key)}
import { chromium } from "playwright-core";
import { readFileSync } from "node:fs";
import { assertCells, num } from "./cells.mjs";

const [url, expectedPath, shot] = process.argv.slice(2);
const want = JSON.parse(readFileSync(expectedPath, "utf8"));
const fail = (msg) => { console.error("FAIL: " + msg); process.exit(1); };
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
const errors = [];
page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
page.on("pageerror", (e) => errors.push(String(e)));
page.on("request", (r) => { if (!/^(file|data|blob):/.test(r.url())) errors.push("network request to " + r.url()); });
await page.goto(url);
await page.waitForSelector("body[data-ready='1']", { timeout: 30000 });
// every ladder size: the slider draws its top edges (at most the page's kept ones), and the
// faithfulness it names is the report's
const max = num(await page.$eval("#size", (e) => e.max));
if (max !== want.sizes.length - 1) fail(`the slider has ${max + 1} sizes, expected ${want.sizes.length}`);
for (let i = 0; i < want.sizes.length; i++) {
  await page.$eval("#size", (e, v) => { e.value = String(v); e.dispatchEvent(new Event("input")); }, i);
  const drawn = await page.$$eval("#graph path.e", (p) => p.length);
  const k = Math.min(want.sizes[i], want.kept);
  if (drawn !== k || num(await page.evaluate(() => document.body.dataset.drawn)) !== k) fail(`size ${i}: ${drawn} edges drawn, expected ${k}`);
  const text = await page.$eval("#sizeText", (e) => e.textContent);
  const f = /faithfulness (-?[0-9.]+)/.exec(text);
  if (!f) fail(`size ${i}: no faithfulness in "${text}"`);
  assertCells(`faithfulness at size ${i}`, { f: num(f[1]) }, { f: want.faithfulness[i] }, 6e-4, fail);
}
// hovering the largest edge names it, with its score and its exact patch
await page.$eval("#graph path.e[data-i='0']", (e) => e.dispatchEvent(new MouseEvent("mousemove", { clientX: 200, clientY: 200, bubbles: true })));
const tip = await page.$eval("#tip", (e) => e.textContent);
const m = /^(\S+) → (\S+): score ([-+0-9.]+), exact Δm ([-+0-9.]+)$/.exec(tip);
if (!m) fail(`the tooltip says "${tip}"`);
if (m[1] !== want.first.from || m[2] !== want.first.to) fail(`the tooltip names ${m[1]} → ${m[2]}, expected ${want.first.from} → ${want.first.to}`);
assertCells("the hovered edge", { score: num(m[3]), exact: num(m[4]) }, { score: want.first.score, exact: want.first.exact }, 6e-6, fail);
// clicking a head shows its attention row as the page embeds it, and its QK split as `qk` has it
const h = want.head;
const view = await page.evaluate((name) => D.head_views.heads.find((x) => x.name === name), h.name);
if (!view) fail(`the page embeds no view of ${h.name}`);
await page.$eval(`#graph circle[data-head='${h.name}']`, (e) => e.dispatchEvent(new MouseEvent("click", { bubbles: true })));
if (await page.evaluate(() => document.body.dataset.head) !== h.name) fail(`clicking ${h.name} did not show it`);
const shown = await page.$$eval("#rowTable td.w", (t) => t.map((x) => x.textContent));
if (shown.length !== view.row.length) fail(`the panel shows ${shown.length} weights, the page embeds ${view.row.length}`);
assertCells(`${h.name}'s attention row`, Object.fromEntries(shown.map((w, j) => [j, num(w)])), Object.fromEntries(view.row.map((w, j) => [j, w])), 6e-6, fail);
const total = view.row.reduce((a, b) => a + b, 0);
if (Math.abs(total - 1) > 1e-5) fail(`${h.name}'s row adds up to ${total}`);
const argmax = view.row.indexOf(Math.max(...view.row));
if (view.key !== argmax || view.key !== h.key || view.query !== h.query) fail(`split of key ${view.key} (query ${view.query}); its row's top key is ${argmax}, qk split key ${h.key} (query ${h.query})`);
const note = await page.$eval("#qkNote", (e) => e.textContent);
const nm = /= (-?[0-9.]+), pre-softmax: its ([0-9]+) terms .* add up to (-?[0-9.]+), gap (-?[0-9.e+-]+);/.exec(note);
if (!nm) fail(`the QK note says "${note}"`);
if (num(nm[2]) !== h.n_terms) fail(`the panel counts ${nm[2]} terms, qk ${h.n_terms}`);
assertCells(`${h.name}'s score and sum`, { score: num(nm[1]), sum: num(nm[3]) }, { score: h.score, sum: h.sum }, 6e-6, fail);
if (Math.abs(num(nm[4]) - h.gap) > Math.max(1e-12, 0.01 * Math.abs(h.gap))) fail(`gap ${nm[4]}, qk's ${h.gap}`);
const terms = await page.$$eval("#qkTable tbody tr", (rs) => rs.map((r) => [...r.children].map((c) => c.textContent)));
if (terms.length !== h.terms.length) fail(`the panel shows ${terms.length} terms, expected ${h.terms.length}`);
terms.forEach(([q, k, v], i) => {
  if (q !== h.terms[i].query_side || k !== h.terms[i].key_side) fail(`term ${i}: ${q} × ${k}, qk has ${h.terms[i].query_side} × ${h.terms[i].key_side}`);
});
assertCells(`${h.name}'s terms`, Object.fromEntries(terms.map((t, i) => [i, num(t[2])])), Object.fromEntries(h.terms.map((t, i) => [i, t.value])), 6e-6, fail);
await page.screenshot({ path: shot, fullPage: true });
if (errors.length) fail("console errors: " + errors.join(" | "));
await browser.close();
console.log("ok");
