// The npm `e2b` SDK against a real aenv server (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY set by
// the caller): create, run, write/read, list, get info, kill. Prints one JSON object.
import { Sandbox } from 'e2b'

const out = {}
const sbx = await Sandbox.create({ metadata: { sdk: 'js' }, envs: { FROM: 'js' }, timeoutMs: 120_000 })
try {
  const run = await sbx.commands.run('echo "$FROM" $(id -un)')
  out.run = run.stdout
  await sbx.files.write('/home/user/js.txt', 'written by js')
  out.read = await sbx.files.read('/home/user/js.txt')
  const paginator = Sandbox.list({ query: { metadata: { sdk: 'js' } } })
  out.listed = (await paginator.nextItems()).map((s) => s.sandboxId).includes(sbx.sandboxId)
  const info = await sbx.getInfo()
  out.info = { templateId: info.templateId, metadata: info.metadata }
  out.running = await sbx.isRunning()
} finally {
  out.killed = await sbx.kill()
}
console.log(JSON.stringify(out))
