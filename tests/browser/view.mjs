// Opens an attnscope view page in headless Chromium and checks it works:
// node view.mjs <url> <expected.json> <screenshot.png>
// expected.json: {"layer": L, "all": lines at the default threshold, "query": i,
//                 "query_lines": lines of query i, "per_head": [lines of each head]}
import { chromium } from "playwright-core";
import { readFileSync } from "node:fs";

const [url, expectedPath, shot] = process.argv.slice(2);
const want = expectedPath === "-" ? null : JSON.parse(readFileSync(expectedPath, "utf8"));
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
if (want) {
  const all = await lines();
  if (all !== want.all) fail(`head view draws ${all} lines, expected ${want.all}`);
  // hover the query token on the left: only its lines remain
  const box = await page.$eval("#head", (c) => { const r = c.getBoundingClientRect(); return { x: r.x, y: r.y }; });
  const ROW = want.row;
  await page.mouse.move(box.x + 40, box.y + 10 + want.query * ROW + ROW / 2);
  const q = await lines();
  if (q !== want.query_lines) fail(`hovering query ${want.query} shows ${q} lines, expected ${want.query_lines}`);
  await page.mouse.move(box.x - 50, box.y - 50);
  // click head 0's swatch: its lines go; double-click head 1: only its lines stay
  await page.click(".sw[data-head='0']");
  const off = await lines();
  if (off !== want.all - want.per_head[0]) fail(`toggling head 0 leaves ${off} lines, expected ${want.all - want.per_head[0]}`);
  await page.dblclick(".sw[data-head='1']");
  const solo = await lines();
  if (solo !== want.per_head[1]) fail(`head 1 alone draws ${solo} lines, expected ${want.per_head[1]}`);
  // the sink toggle renormalizes without errors; the large view opens on click
  await page.check("#nosink");
  await page.click("#grid", { position: { x: 45, y: 25 } });
}
if (shot) await page.screenshot({ path: shot, fullPage: true });
if (errors.length) fail("console errors: " + errors.join(" | "));
await browser.close();
console.log("ok");
