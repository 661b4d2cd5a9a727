// The npm `e2b` SDK against a cluster's gateway (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY set by
// the caller): create, a command, a file written and read, pause, connect (the resume goes
// through the gateway to whichever node holds it), the file and a command again, kill. Prints
// one JSON object.
import { Sandbox } from 'e2b'

const out = {}
const sbx = await Sandbox.create('base', { metadata: { sdk: 'js' }, timeoutMs: 300_000 })
try {
  out.run = (await sbx.commands.run('echo js through the gateway')).stdout
  await sbx.files.write('/home/user/js.txt', 'kept by js')
  out.read = await sbx.files.read('/home/user/js.txt')
  out.paused = await sbx.pause()
  out.stateWhilePaused = (await Sandbox.getInfo(sbx.sandboxId)).state
  const resumed = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 300_000 })
  out.readAfterResume = await resumed.files.read('/home/user/js.txt')
  out.runAfterResume = (await resumed.commands.run('echo resumed')).stdout
} finally {
  out.killed = await sbx.kill()
}
out.gone = !(await Sandbox.list({ query: { metadata: { sdk: 'js' } } }).nextItems()).length
console.log(JSON.stringify(out))
