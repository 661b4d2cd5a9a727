// The npm `e2b` SDK against a real aenv server (issue 15): an unimplemented field (`mcp`) is
// refused by name, setTimeout(0) pauses a sandbox whose lifecycle says pause, and the guest
// resolves its own hostname. Prints one JSON object.
import { Sandbox } from 'e2b'

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const out = {}
try {
  await Sandbox.create({ mcp: { exa: { apiKey: 'x' } } })
  out.mcp = 'accepted'
} catch (e) {
  out.mcp = String(e.message).includes("field 'mcp' is not supported here") ? 'refused' : String(e)
}
const sbx = await Sandbox.create({ timeoutMs: 120_000, lifecycle: { onTimeout: 'pause' } })
try {
  const hosts = await sbx.commands.run('getent hosts $(hostname) && sudo -n true 2>&1', { user: 'root' })
  out.resolves = hosts.stdout.includes(sbx.sandboxId) && !hosts.stdout.includes('unable to resolve')
  await sbx.setTimeout(0)
  let state = 'running'
  for (let i = 0; i < 240 && state !== 'paused'; i++) {
    await sleep(500)
    state = (await Sandbox.getInfo(sbx.sandboxId)).state
  }
  out.afterTimeoutZero = state
} finally {
  out.killed = await sbx.kill()
}
console.log(JSON.stringify(out))
