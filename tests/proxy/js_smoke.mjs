// The npm `e2b` SDK through the proxy: a Sandbox object as after a create against our server
// (everything to E2B_SANDBOX_URL, the sandbox named by E2b-Sandbox-Id/-Port headers). Run by
// tests/proxy/test_js_sdk.py, which passes the SDK module's path (the envd tests install it);
// prints one JSON object with what it observed.
const { Sandbox } = await import(process.env.E2B_MODULE)

const sbx = new Sandbox({
  sandboxId: process.env.SANDBOX_ID,
  sandboxDomain: 'aenv.test',
  envdVersion: process.env.ENVD_VERSION,
  sandboxUrl: process.env.PROXY_URL,
  apiUrl: process.env.PROXY_URL,
  apiKey: 'e2b_' + '0'.repeat(40),
  debug: false,
})
const dir = process.env.SMOKE_DIR
const out = {}

const run = await sbx.commands.run('echo hello; echo err >&2')
out.run = { stdout: run.stdout, stderr: run.stderr, exitCode: run.exitCode }

const chunks = []
await sbx.commands.run('for i in 1 2 3; do echo $i; done', { onStdout: (d) => chunks.push(d) })
out.streamed = chunks.join('')

const events = []
const watcher = await sbx.files.watchDir(dir, (e) => events.push(e.type))
const big = 'x'.repeat(3 * 1024 * 1024)
await sbx.files.write(`${dir}/big.txt`, big)
out.bigReadBack = (await sbx.files.read(`${dir}/big.txt`)) === big
for (let i = 0; i < 100 && !events.includes('write'); i++) {
  await new Promise((resolve) => setTimeout(resolve, 50))
}
await watcher.stop()
out.watched = events.includes('write')
out.running = await sbx.isRunning()

console.log(JSON.stringify(out))
