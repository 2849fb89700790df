// Start a deployment from the Prefect UI (new UI, /v2) with one custom parameter and wait until the run completes.
//   node custom_run.mjs <ui_base> <deployment_id> <field label> <value> <screenshot.png>
// Only loopback requests are allowed (the new UI calls an analytics host even with analytics disabled).
import { chromium } from 'playwright-core';

const [base, deploymentId, label, value, shot] = process.argv.slice(2);
const log = (...a) => console.log(new Date().toISOString(), ...a);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium', headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
         '--disable-component-update', '--disable-sync'],
});
let code = 1;
const context = await browser.newContext({ viewport: { width: 1400, height: 1000 } });
await context.route('**/*', (route) => {
  const u = new URL(route.request().url());
  return ['127.0.0.1', 'localhost'].includes(u.hostname) || u.protocol === 'data:' ? route.continue() : route.abort();
});
const page = await context.newPage();
// the deployment's flow runs, newest first (Prefect REST API beside the UI)
async function deploymentRuns() {
  const r = await fetch(`${base}/api/flow_runs/filter`, {
    method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ deployments: { id: { any_: [deploymentId] } }, sort: 'EXPECTED_START_TIME_DESC', limit: 50 }),
  });
  if (!r.ok) throw new Error(`flow run filter: HTTP ${r.status}`);
  return r.json();
}
page.setDefaultTimeout(60000);
try {
  await page.goto(`${base}/v2/deployments/deployment/${deploymentId}`, { waitUntil: 'domcontentloaded' });
  log('deployment page');
  await page.getByRole('button', { name: 'Run', exact: true }).first().click();
  await page.getByRole('menuitem', { name: 'Custom run' }).click();
  log('custom run form');
  const field = page.getByLabel(label).first();
  await field.waitFor();
  await field.fill(value);
  await page.screenshot({ path: shot.replace(/\.png$/, '-form.png'), fullPage: true });
  const runsBefore = new Set((await deploymentRuns()).map((r) => r.id));
  // what the submit asked the API and what it answered: tells a form that sent nothing from a server that refused
  const creates = [];
  let sent = 0;  // requests that left the page (a slow server may not have answered yet: never submit twice then)
  page.on('request', (q) => { if (/\/create_flow_run\b/.test(q.url()) && q.method() === 'POST') sent += 1; });
  page.on('response', async (r) => {
    if (!/\/create_flow_run\b/.test(r.url()) || r.request().method() !== 'POST') return;
    const body = await r.text().catch(() => '');
    creates.push({ status: r.status(), body: body.slice(0, 500) });
    log('create_flow_run answered', r.status(), r.status() >= 400 ? body.slice(0, 500) : '');
  });
  const submit = page.getByRole('button', { name: 'Submit' });
  await submit.click();
  log('submitted');
  const onRun = /flow-run\/[0-9a-f-]{36}/;
  // the new UI stays on the form and shows a toast "<name> scheduled to start now · View run" for a few seconds:
  // click it while it is there (waiting first lets the toast expire); older UIs navigate to the run themselves
  const viewRun = page.locator('[data-sonner-toast]').getByText('View run').last();
  await Promise.race([
    page.waitForURL(onRun, { timeout: 30000, waitUntil: 'commit' }),
    viewRun.waitFor({ timeout: 30000 }).then(async () => {
      log('toasts:', JSON.stringify(await page.locator('[data-sonner-toast]').allInnerTexts().catch(() => [])));
      await viewRun.click({ timeout: 5000 });
    }),
  ]).catch((e) => log('no run link yet:', e.message.split('\n')[0]));
  if (!onRun.test(page.url())) {
    await page.screenshot({ path: shot.replace(/\.png$/, '-after-submit.png'), fullPage: true }).catch(() => {});
    // the form's own messages (fields marked invalid, error toasts), not the field descriptions
    const invalid = await page.locator('[aria-invalid=true]').evaluateAll(
      (els) => els.map((e) => e.getAttribute('name') || e.id || e.getAttribute('aria-label') || e.tagName)).catch(() => []);
    const toasts = await page.locator('[data-sonner-toast]').allInnerTexts().catch(() => []);
    if (invalid.length) log('fields marked invalid:', JSON.stringify(invalid.slice(0, 10)));
    if (toasts.length) log('toasts:', JSON.stringify(toasts));
    // no request left the page (the click landed while the form was still settling): submit once more. A 5xx is
    // retried once, as Prefect's own client retries it: the server answers 503 "Service Unavailable" for errors
    // it deems retryable (prefect/server/api/server.py), and did so here for the UI's create_flow_run on a loaded
    // 2-core machine (seen locally 2026-12-02: 503, then 201 on the second submit) — the UI only shows a toast.
    // A 4xx is the answer.
    const refused = creates.find((c) => c.status >= 400 && c.status < 500);
    if (refused) throw new Error(`the API refused the run: HTTP ${refused.status} ${refused.body}`);
    // A loaded server's SQLite can stay locked for a while (503 twice in a row seen in a CI-like run with two test
    // workers): up to 4 more submits, each only after every earlier one was answered 5xx and no run exists, with a
    // growing pause.
    for (let attempt = 1; attempt <= 4; attempt++) {
      const resubmit = sent === 0 || (creates.length === sent && creates.every((c) => c.status >= 500));
      if (!(resubmit && !(await deploymentRuns()).some((r) => !runsBefore.has(r.id))
            && await submit.isVisible().catch(() => false))) break;
      log(creates.length ? `server error, submitting again (${attempt})` : 'no request was sent, submitting again');
      await page.waitForTimeout(attempt * 3000);
      await submit.click();
      await page.waitForTimeout(1000);
      for (let i = 0; i < 30 && creates.length < sent; i++) await page.waitForTimeout(500);  // its answer
    }
    // the form submitted but the UI did not take us to the run (toast gone or missed): find the run the submit
    // created through the API and open its page
    let created = null;
    for (let i = 0; i < 60 && !created; i++) {  // up to 2 min: a loaded server can be slow to create it
      created = (await deploymentRuns()).find((r) => !runsBefore.has(r.id)) || null;
      if (!created) await page.waitForTimeout(2000);
    }
    if (!created) throw new Error(`the submit created no flow run of the deployment (create_flow_run requests: ${JSON.stringify(creates)})`);
    log('run found through the API', created.id);
    await page.goto(`${base}/v2/runs/flow-run/${created.id}`, { waitUntil: 'domcontentloaded' });
  }
  const runUrl = page.url();
  log('flow run page', runUrl);
  const deadline = Date.now() + Number(process.env.UI_RUN_TIMEOUT_MS || 480000);
  let state = '';
  while (Date.now() < deadline) {
    const badges = await page.locator('[data-slot=badge]').allInnerTexts().catch(() => []);
    state = badges.find((t) => /Completed|Failed|Crashed|Cancelled/.test(t)) || '';
    if (state) break;
    await page.waitForTimeout(3000);
    if ((Date.now() / 1000) % 30 < 3) await page.reload({ waitUntil: 'domcontentloaded' });
  }
  await page.screenshot({ path: shot, fullPage: true });
  console.log(JSON.stringify({ runUrl, runId: runUrl.match(/flow-run\/([0-9a-f-]{36})/)[1], state }));
  code = /Completed/.test(state) ? 0 : 2;
} catch (e) {
  console.error('UI step failed:', e.message);
  await page.screenshot({ path: shot, fullPage: true }).catch(() => {});
} finally {
  await browser.close();
}
process.exit(code);
