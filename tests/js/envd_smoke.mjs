// Smoke set for the npm `e2b` SDK against our envd in debug mode (E2B_DEBUG=true: no control
// plane, envd on localhost:49983). Run by tests/envd/test_js_sdk.py with SMOKE_DIR set to a
// fresh directory under the user's home; prints one JSON object with what it observed.
import { CommandExitError, FileType, Sandbox } from 'e2b'

const dir = process.env.SMOKE_DIR
const out = {}
const sbx = await Sandbox.create()

const run = await sbx.commands.run('echo hello; echo err >&2; id -un; pwd')
out.run = { stdout: run.stdout, stderr: run.stderr, exitCode: run.exitCode }

try {
  await sbx.commands.run('exit 3')
  out.exit = 'no error'
} catch (e) {
  out.exit = { isCommandExitError: e instanceof CommandExitError, exitCode: e.exitCode }
}

const envCwd = await sbx.commands.run('echo "$FOO"; pwd', { envs: { FOO: 'bar' }, cwd: '/tmp', user: 'root' })
out.envCwd = envCwd.stdout

const chunks = []
const background = await sbx.commands.run('sleep 1000', { background: true })
out.listed = (await sbx.commands.list()).some((p) => p.pid === background.pid)
out.killed = await sbx.commands.kill(background.pid)
try {
  await background.wait()
} catch (e) {
  out.killedExitCode = e.exitCode
}
const streamed = await sbx.commands.run('for i in 1 2 3; do echo $i; done', {
  onStdout: (data) => chunks.push(data),
})
out.streamed = { joined: chunks.join(''), stdout: streamed.stdout }

const events = []
const watcher = await sbx.files.watchDir(dir, (event) => events.push([event.type, event.name]))

const info = await sbx.files.write(`${dir}/hello.txt`, 'hello from js')
out.write = { path: info.path, name: info.name }
out.read = await sbx.files.read(`${dir}/hello.txt`)
const bytes = await sbx.files.read(`${dir}/hello.txt`, { format: 'bytes' })
out.readBytesLength = bytes.length
await sbx.files.write([
  { path: `${dir}/a/one.txt`, data: '1' },
  { path: `${dir}/a/b/two.txt`, data: new Blob(['2']) },
])
out.list = (await sbx.files.list(dir)).map((e) => [e.name, e.type]).sort()
out.listDeep = (await sbx.files.list(dir, { depth: 3 })).map((e) => e.path).sort()
const stat = await sbx.files.getInfo(`${dir}/hello.txt`)
out.stat = { size: stat.size, owner: stat.owner, permissions: stat.permissions, isFile: stat.type === FileType.FILE }
out.exists = [await sbx.files.exists(`${dir}/hello.txt`), await sbx.files.exists(`${dir}/nope`)]
out.makeDir = [await sbx.files.makeDir(`${dir}/new`), await sbx.files.makeDir(`${dir}/new`)]
await sbx.files.rename(`${dir}/hello.txt`, `${dir}/renamed.txt`)
out.renamed = await sbx.files.read(`${dir}/renamed.txt`)
await sbx.files.remove(`${dir}/renamed.txt`)
out.removed = !(await sbx.files.exists(`${dir}/renamed.txt`))

for (let i = 0; i < 200 && !events.some(([t, n]) => t === 'write' && n === 'hello.txt'); i++) {
  await new Promise((r) => setTimeout(r, 50))
}
await watcher.stop()
out.watchEvents = events.filter(([, n]) => n === 'hello.txt').map(([t]) => t)

console.log(JSON.stringify(out))
