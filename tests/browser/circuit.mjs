// Opens an `attnscope circuit --html` page in headless Chromium and drives it:
// node circuit.mjs <url> <expected.json> <screenshot.png>
// expected.json: {"n_edges", "kept", "sizes": [ladder edge counts], "faithfulness": [per size],
// "first": {"from", "to", "score", "exact"} (the largest edge)}
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
await page.screenshot({ path: shot, fullPage: true });
if (errors.length) fail("console errors: " + errors.join(" | "));
await browser.close();
console.log("ok");
