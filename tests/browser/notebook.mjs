// Opens a page holding several notebook views (attnscope's _repr_html_: sandboxed iframes) in
// headless Chromium: node notebook.mjs <file.html> <views> <screenshot.png>. Each view must load,
// draw its head view, keep a unique id, and nothing may reach the network or log an error.
import { chromium } from "playwright-core";

const [file, views, shot] = process.argv.slice(2);
const fail = (msg) => { console.error("FAIL: " + msg); process.exit(1); };
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const page = await browser.newPage({ viewport: { width: 1400, height: 1800 } });
const errors = [];
page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
page.on("pageerror", (e) => errors.push(String(e)));
page.on("request", (r) => { const u = r.url(); if (!u.startsWith("file:") && !u.startsWith("data:") && !u.startsWith("blob:") && !u.startsWith("about:")) errors.push("network request to " + u); });
await page.goto("file://" + file);
const frames = await page.$$("iframe.attnscope-view");
if (frames.length !== Number(views)) fail(`${frames.length} views on the page, expected ${views}`);
const ids = new Set();
for (const f of frames) {
  ids.add(await f.getAttribute("id"));
  const fr = await f.contentFrame();
  await fr.waitForSelector("body[data-ready='1']", { timeout: 30000 });
  const lines = Number(await fr.$eval("#head", (c) => c.dataset.lines));
  if (!(lines > 0)) fail(`a view draws ${lines} lines`);
}
if (ids.size !== frames.length) fail(`view ids are not unique: ${[...ids]}`);
if (shot) await page.screenshot({ path: shot, fullPage: true });
if (errors.length) fail("console errors: " + errors.join(" | "));
await browser.close();
console.log("ok");
