// Opens an `attnscope compare --html` page in headless Chromium and drives it:
// node compare.mjs <url> <expected.json> <screenshot.png>
// expected.json: {"n_a": tokens of A, "n_b": tokens of B, "layer": l, "head": h, "js": JS of (l, h)}
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
const page = await browser.newPage({ viewport: { width: 1400, height: 1400 } });
const errors = [];
page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
page.on("pageerror", (e) => errors.push(String(e)));
page.on("request", (r) => { if (!/^(file|data|blob):/.test(r.url())) errors.push("network request to " + r.url()); });
await page.goto(url);
await page.waitForSelector("body[data-ready='1']", { timeout: 30000 });
const na = await page.$$eval("#proseA .tok", (s) => s.length), nb = await page.$$eval("#proseB .tok", (s) => s.length);
if (na !== want.n_a || nb !== want.n_b) fail(`prose shows ${na} and ${nb} tokens, expected ${want.n_a} and ${want.n_b}`);
// both sides' query is outlined
if ((await page.$$("#proseA .tok.q")).length !== 1 || (await page.$$("#proseB .tok.q")).length !== 1) fail("each side outlines one query token");
// a click on the grid cell selects that head; the page's JS of it is the report's
await page.click(`#grid td[data-l='${want.layer}'][data-h='${want.head}']`);
const sel = await page.evaluate(() => [document.getElementById("layer").value, document.getElementById("head").value, document.body.dataset.js]);
if (num(sel[0]) !== want.layer || num(sel[1]) !== want.head) fail(`the grid click selected ${sel[0]}.${sel[1]}, expected ${want.layer}.${want.head}`);
assertCells(`JS of ${want.layer}.${want.head} on the page`, { js: num(sel[2]) }, { js: want.js }, 1e-6, fail);
// the head-averaged column and the keyboard move the selection
await page.click(`#grid td[data-l='0'][data-h='-1']`);
if (+(await page.$eval("#head", (e) => e.value)) !== -1) fail("the mean column did not select the head average");
await page.keyboard.press("ArrowRight");
if (+(await page.$eval("#head", (e) => e.value)) !== 0) fail("→ did not move to head 0");
await page.check("#nosink");
await page.screenshot({ path: shot, fullPage: true });
if (errors.length) fail("console errors: " + errors.join(" | "));
await browser.close();
console.log("ok");
