// The UI's pages in Firefox (Debian's firefox-esr, through WebDriver BiDi; puppeteer-core downloads no
// browser): each view must draw and log no error. The suite runs it (tests/ui/test_browser.py) over the
// runs, registry and server it makes; by hand:
// `make ui-firefox-check URL=http://127.0.0.1:8080 VIEWS="/run/ID /registry/NAME"` against a running
// `mlscale ui`: the runs, registry and serving views, and those named.
import puppeteer from "puppeteer-core";

const base = process.argv[2] || "http://127.0.0.1:8080";
const views = ["/runs", "/registry", "/serving", ...process.argv.slice(3)];
const browser = await puppeteer.launch({
  browser: "firefox", executablePath: process.env.FIREFOX || "/usr/bin/firefox-esr", headless: true,
});
const version = await browser.version();
let failed = 0;
for (const view of views) {
  const page = await browser.newPage();
  const errors = [];
  page.on("console", (message) => { if (message.type() === "error") errors.push(message.text()); });
  page.on("pageerror", (error) => errors.push(String(error)));
  const start = Date.now();
  await page.goto(`${base}/#${view}`);
  await page.hover(".chart").catch(() => {});  // a tooltip, where the view has a chart
  await page.waitForSelector("body[data-ready]", { timeout: 60000 });
  const charts = await page.$$eval(".chart canvas", (canvases) => canvases.length);
  console.log(`${version} ${view}: drawn in ${Date.now() - start} ms, ${charts} chart canvas(es), ${errors.length} error(s)`);
  for (const error of errors) console.log(`  ${error}`);
  failed += errors.length;
  await page.close();
}
await browser.close();
process.exit(failed ? 1 : 0);
