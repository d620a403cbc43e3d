// Opens an attnscope view page in headless Chromium, drives its text view and measures it:
// node longview.mjs <url> <expected.json|-> <measurements.json> <screenshot.png>
// expected.json: {"checks": [{"layer", "head" (-1 = head average), "query", "measure", "values": [..],
//                 "tol"}]}: the values the text view must shade by.
// measurements.json gets: ready_ms (navigation start to the drawn text view), first_contentful_paint_ms,
// layer_switch_ms (each layer switch: decode + text view + head table), query_switch_ms.
import { chromium } from "playwright-core";
import { readFileSync, writeFileSync } from "node:fs";
import { assertCells } from "./cells.mjs";

const [url, expectedPath, outPath, shot] = process.argv.slice(2);
const want = expectedPath === "-" ? null : JSON.parse(readFileSync(expectedPath, "utf8"));
const fail = (msg) => { console.error("FAIL: " + msg); process.exit(1); };
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const page = await browser.newPage({ viewport: { width: 1400, height: 1600 } });
const errors = [];
page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
page.on("pageerror", (e) => errors.push(String(e)));
page.on("request", (r) => { if (!/^(file|data|blob):/.test(r.url())) errors.push("network request to " + r.url()); });
await page.goto(url, { timeout: 120000 });
await page.waitForSelector("body[data-ready='1']", { timeout: 120000 });
const ready_ms = Number(await page.$eval("body", (b) => b.dataset.readyAtMs));
const fcp = await page.evaluate(() => { const e = performance.getEntriesByName("first-contentful-paint")[0]; return e ? e.startTime : null; });
const L = await page.evaluate(() => window.attnscope.state.layer + 1);
const n = await page.$$eval("#prose span", (s) => s.length);
// every layer once, from the last but one down: each is decoded for the first time
const layer_switch_ms = [];
for (let l = L - 2; l >= 0; l--) {
  const ms = await page.evaluate(async (l) => {
    const t = performance.now();
    await window.attnscope.showLayer(l);
    await new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));
    return performance.now() - t;
  }, l);
  layer_switch_ms.push(ms);
}
// the query by click and by arrow key
const q0 = await page.evaluate(() => window.attnscope.state.query);
const target = Math.max(0, q0 - 3);
await page.click(`#prose span[data-i='${target}']`);
await page.waitForFunction((t) => window.attnscope.shown() && window.attnscope.shown().query === t, target);
await page.keyboard.press("ArrowLeft");
await page.waitForFunction((t) => window.attnscope.shown().query === t - 1, target);
const query_switch_ms = await page.evaluate(async () => {
  const t = performance.now();
  await window.attnscope.setQuery(window.attnscope.state.query - 1);
  return performance.now() - t;
});
// masked keys after the query are drawn as such
const q = await page.evaluate(() => window.attnscope.state.query);
const futureOk = await page.$$eval("#prose span", (s, q) => s.every((x, i) => (i > q) === x.classList.contains("future")), q);
if (!futureOk) fail("keys after the query are not marked as masked");
if (want) {
  for (const c of want.checks) {
    const got = await page.evaluate(async (c) => {
      const a = window.attnscope;
      a.state.tvhead = c.head; a.state.measure = c.measure; a.state.nosink = !!c.nosink;
      a.state.layer = c.layer;
      await a.setQuery(c.query);
      return Array.from(a.shown().values);
    }, c);
    assertCells(`layer ${c.layer} head ${c.head} query ${c.query} ${c.measure}${c.nosink ? " without the first token" : ""}: text view [key]`, got, c.values, c.tol, fail);
  }
}
if (shot) await page.screenshot({ path: shot, fullPage: false });
if (errors.length) fail("console errors: " + errors.join(" | "));
writeFileSync(outPath, JSON.stringify({ n, ready_ms, first_contentful_paint_ms: fcp, layer_switch_ms, query_switch_ms }));
await browser.close();
console.log("ok");
