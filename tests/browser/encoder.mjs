// Opens an encoder's view page (BERT) in headless Chromium and checks what is particular to it:
// node encoder.mjs <url> <expected.json> <screenshot.png>
// expected.json: {"all": lines of the last layer at the default threshold, "row": ROW,
//   "pair": {"AB": lines, "BA": …, "AA": …, "BB": …} or null, "cls_lines": lines of query 0,
//   "text_row": the head-averaged row of query 0 as stored (n values), "sentence_b_start": b or null}
import { chromium } from "playwright-core";
import { readFileSync } from "node:fs";
import { assertCells } from "./cells.mjs";

const [url, expectedPath, shot] = process.argv.slice(2);
const want = JSON.parse(readFileSync(expectedPath, "utf8"));
const fail = (msg) => { console.error("FAIL: " + msg); process.exit(1); };
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const page = await browser.newPage({ viewport: { width: 1400, height: 1800 } });
const errors = [];
page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
page.on("pageerror", (e) => errors.push(String(e)));
page.on("request", (r) => { if (!r.url().startsWith("file:") && !r.url().startsWith("data:") && !r.url().startsWith("blob:") && !r.url().startsWith(url.split("/view")[0])) errors.push("network request to " + r.url()); });
await page.goto(url);
await page.waitForSelector("body[data-ready='1']", { timeout: 30000 });
const lines = async () => Number(await page.$eval("#head", (c) => c.dataset.lines));
const visible = (id) => page.$eval("#" + id, (e) => getComputedStyle(e).display !== "none" && !e.classList.contains("hidden"));
// the note says why there is no prediction panel; the next-token panels stay hidden
const note = await page.$eval("#encnotetext", (e) => e.textContent);
if (!(await visible("encnote")) || !note.includes("no prediction panel")) fail(`the encoder note is missing: ${note}`);
for (const id of ["ablation", "faith"]) if (await visible(id)) fail(`#${id} is shown on an encoder's page`);
const sinkTitle = await page.$eval("#sinkview h2", (e) => e.textContent);
if (!sinkTitle.includes("[CLS]")) fail(`the chart is not the [CLS]/[SEP] shares: ${sinkTitle}`);
// the text view: query 0 ([CLS]) shades every token after it; its values are the stored row
const tv = await page.evaluate(() => { const s = window.attnscope.shown(); return { q: s.query, values: [...s.values], future: document.querySelectorAll("#prose span.future").length }; });
if (tv.q !== 0) fail(`the text view starts at query ${tv.q}, expected 0 ([CLS])`);
if (tv.future !== 0) fail(`${tv.future} tokens are greyed out as after the query; an encoder's query sees them`);
assertCells("the text view's weights of query 0 [key]", tv.values, want.text_row, 2e-5, fail);
const shaded = await page.$$eval("#prose span", (s) => s.filter((e) => e.style.background !== "").length);
if (shaded !== want.text_row.length) fail(`${shaded} tokens shaded, expected all ${want.text_row.length}`);
// the head view: whole squares (keys after the query drawn too)
const all = await lines();
if (all !== want.all) fail(`head view draws ${all} lines, expected ${want.all}`);
const box = await page.$eval("#head", (c) => { const r = c.getBoundingClientRect(); return { x: r.x, y: r.y }; });
await page.mouse.move(box.x + 40, box.y + 10 + want.row / 2);
const cls = await lines();
if (cls !== want.cls_lines) fail(`hovering [CLS] shows ${cls} lines, expected ${want.cls_lines}`);
await page.mouse.move(box.x - 50, box.y - 50);
const pairShown = await visible("pairsel");
if (want.pair) {
  if (!pairShown) fail("no sentence selector on a pair's page");
  for (const [sel, n] of Object.entries(want.pair)) {
    await page.selectOption("#pair", sel);
    const got = await lines();
    if (got !== n) fail(`${sel}: ${got} lines, expected ${n}`);
    const r = await page.evaluate(() => window.attnscope.pairRanges());
    const b = want.sentence_b_start, part = (c) => c === "A" ? [0, b] : [b, want.text_row.length];
    if (JSON.stringify(r) !== JSON.stringify([...part(sel[0]), ...part(sel[1])])) fail(`${sel}: ranges ${r}`);
  }
  await page.selectOption("#pair", "AB");
  if (shot) await page.screenshot({ path: shot, fullPage: true });
  await page.selectOption("#pair", "all");
  if ((await lines()) !== want.all) fail("back to all: the line count differs");
} else {
  if (pairShown) fail("a sentence selector on a single text's page");
  if (shot) await page.screenshot({ path: shot, fullPage: true });
}
await page.check("#nosink");
await page.click("#grid", { position: { x: 45, y: 25 } });
if (errors.length) fail("console errors: " + errors.join(" | "));
await browser.close();
console.log("ok");
