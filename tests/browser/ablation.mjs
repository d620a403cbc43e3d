// Drives a `view --ablate` page and `patch --html` pages in headless Chromium:
// node ablation.mjs <expected.json> <screenshot folder>
// expected.json: {"view": url, "layers": L, "heads": H,
//                 "top": {"layer", "head", "delta"} (the table's first row), "other": a head,
//                 "top_kl": the head with the largest KL,
//                 "patches": [{"url", "i": a cell, "cell": {layer, pos|head, logit_diff, recovered}, "cells": count}]}
import { chromium } from "playwright-core";
import { readFileSync } from "node:fs";
import { assertCells, num } from "./cells.mjs";

const [expectedPath, shots] = process.argv.slice(2);
const want = JSON.parse(readFileSync(expectedPath, "utf8"));
const fail = (msg) => { console.error("FAIL: " + msg); process.exit(1); };
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const errors = [];
async function open(url) {
  const page = await browser.newPage({ viewport: { width: 1400, height: 1800 } });
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("request", (r) => { if (!/^(file|data|blob):/.test(r.url())) errors.push("network request to " + r.url()); });
  await page.goto(url);
  await page.waitForSelector("body[data-ready='1']", { timeout: 30000 });
  return page;
}
const signed = (v, d) => (v >= 0 ? "+" : "") + v.toFixed(d);

// ---------- the view's ablation panel ----------
const page = await open(want.view);
if (!(await page.isVisible("#ablation"))) fail("the ablation panel is not shown");
const cells = await page.$$eval("#ablgrid td[data-l]", (t) => t.length);
if (cells !== want.layers * want.heads) fail(`the grid has ${cells} cells, expected ${want.layers * want.heads}`);
// the top cell's tooltip holds its Δ log p
const title = await page.$eval(`#ablgrid td[data-l='${want.top.layer}'][data-h='${want.top.head}']`, (e) => e.title);
if (!title.includes("Δ log p " + signed(want.top.delta, 4))) fail(`the cell's tooltip "${title}" lacks Δ log p ${signed(want.top.delta, 4)}`);
// what the attention views show now, to compare after each click
const selected = () => page.evaluate(() => ({
  layer: +document.getElementById("layer").value,
  tvhead: +document.getElementById("tvhead").value,
  shown: window.attnscope.shown(),
  large: document.getElementById("largetitle").firstChild.textContent,
  on: [...document.querySelectorAll(".sw:not(.off)")].map((s) => +s.dataset.head),
  sel: document.body.dataset.selected,
}));
async function expectSelected(l, h, what) {
  await page.waitForSelector(`body[data-selected='${l}.${h}']`, { timeout: 10000 });
  const s = await selected();
  if (s.layer !== l) fail(`${what}: the layer select shows ${s.layer}, expected ${l}`);
  if (s.tvhead !== h || s.shown.head !== h || s.shown.layer !== l) fail(`${what}: the text view shows layer ${s.shown.layer} head ${s.shown.head}, expected ${l}.${h}`);
  if (!s.large.startsWith(`Layer ${l}, head ${h} `)) fail(`${what}: the large map shows "${s.large}", expected layer ${l}, head ${h}`);
  if (s.on.length !== 1 || s.on[0] !== h) fail(`${what}: the head view shows heads ${s.on}, expected ${h} alone`);
  const marked = await page.$$eval("#ablation .sel", (e) => e.map((x) => x.dataset.l + "." + x.dataset.h));
  if (!marked.length || marked.some((m) => m !== `${l}.${h}`)) fail(`${what}: marked ${marked}, expected ${l}.${h}`);
}
// the table's first row is the head whose removal moves log p most; a click selects it
const first = await page.$eval("#abltable tr.row", (r) => [+r.dataset.l, +r.dataset.h]);
if (first[0] !== want.top.layer || first[1] !== want.top.head) fail(`the first row is ${first}, expected ${want.top.layer}.${want.top.head}`);
const rows = await page.$$eval("#abltable tr.row", (r) => r.length);
if (rows !== Math.min(15, want.layers * want.heads)) fail(`the table shows ${rows} rows, expected the top 15`);
await page.click("#abltable tr.row");
await expectSelected(want.top.layer, want.top.head, "the top row");
await page.screenshot({ path: `${shots}/ablation-top-row.png`, fullPage: true });
// a grid cell selects its head
await page.click(`#ablgrid td[data-l='${want.other.layer}'][data-h='${want.other.head}']`);
await expectSelected(want.other.layer, want.other.head, "a grid cell");
// sorting by KL puts the largest KL first; "all" shows every head
await page.click("#abltable th[data-key='kl']");
const kl = await page.$eval("#abltable tr.row", (r) => [+r.dataset.l, +r.dataset.h]);
if (kl[0] !== want.top_kl.layer || kl[1] !== want.top_kl.head) fail(`sorted by KL, the first row is ${kl}, expected ${want.top_kl.layer}.${want.top_kl.head}`);
await page.selectOption("#abltop", "0");
const all = await page.$$eval("#abltable tr.row", (r) => r.length);
if (all !== want.layers * want.heads) fail(`"all" shows ${all} rows`);
const corr = await page.$$eval("#ablcorr tr", (r) => r.length);
if (corr < 2) fail("no rank correlations");

// ---------- the patch pages ----------
for (const p of want.patches) {
  const pg = await open(p.url);
  const n = await pg.$$eval("#grid td[data-i]", (t) => t.length);
  if (n !== p.cells) fail(`${p.url}: ${n} cells, expected ${p.cells}`);
  await pg.click(`#grid td[data-i='${p.i}']`);
  const d = await pg.$eval("#detail", (e) => ({ ...e.dataset, text: e.textContent }));
  const c = p.cell;
  if (+d.index !== p.i || +d.layer !== c.layer) fail(`${p.url}: the detail shows cell ${d.index} (layer ${d.layer}), expected ${p.i} (layer ${c.layer})`);
  // the page holds the report's f32 numbers: equal once both are rounded to f32
  assertCells(`${p.url}: the detail's numbers`, { recovered: Math.fround(num(d.recovered)), logit_diff: Math.fround(num(d.logitDiff)) }, { recovered: Math.fround(c.recovered), logit_diff: Math.fround(c.logit_diff) }, 0, fail);
  if (!d.text.includes(c.recovered.toFixed(4)) || !d.text.includes(signed(c.logit_diff, 4))) fail(`${p.url}: the detail reads "${d.text}"`);
  if (c.head !== undefined && (+d.head !== c.head || !d.text.includes("head" + c.head))) fail(`${p.url}: the detail does not name head ${c.head}: ${d.head} "${d.text}"`);
  if (c.pos !== undefined && +d.pos !== c.pos) fail(`${p.url}: the detail shows position ${d.pos}, expected ${c.pos}`);
  const marked = await pg.$$eval("#grid td.sel", (e) => e.map((x) => +x.dataset.i));
  if (marked.length !== 1 || marked[0] !== p.i) fail(`${p.url}: marked ${marked}`);
  await pg.screenshot({ path: `${shots}/patch-${c.head !== undefined ? "head" : "position"}.png`, fullPage: true });
}
if (errors.length) fail("console errors: " + errors.join(" | "));
await browser.close();
console.log("ok");
