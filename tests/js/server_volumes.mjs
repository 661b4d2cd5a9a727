// The npm `e2b` SDK's volumes against a real aenv server (issue 15): a volume created, listed and
// mounted by two sandboxes that see each other's writes, its files read and written through the
// volume content API while mounted, refused while mounted, then destroyed. Prints one JSON object.
import { Sandbox, Volume } from 'e2b'

// The content API is served by the node itself (E2B serves it on its own host).
process.env.E2B_VOLUME_API_URL ??= process.env.E2B_API_URL

const out = {}
// A create with volumes boots a VM (not a restore): under emulation on a busy host that can take
// longer than the SDK's default request timeout, and each sandbox must outlive the others' boots.
const requestTimeoutMs = 300_000
const volume = await Volume.create('js-shared')
out.listed = (await Volume.list()).some((v) => v.volumeId === volume.volumeId && v.name === 'js-shared')
const a = await Sandbox.create({ timeoutMs: 900_000, requestTimeoutMs, volumeMounts: { '/mnt/js': volume } })
const b = await Sandbox.create({
  timeoutMs: 900_000,
  requestTimeoutMs,
  volumeMounts: { '/mnt/js': 'js-shared' },
})
try {
  await a.files.write('/mnt/js/from-a', 'written by js a')
  out.readInB = await b.files.read('/mnt/js/from-a')
  out.readByApi = await volume.readFile('/from-a')
  await volume.writeFile('/from-api', 'written by the js api')
  out.apiWriteInA = await a.files.read('/mnt/js/from-api')
  out.apiList = (await volume.list('/')).map((e) => e.name).sort()
  out.info = (await Sandbox.getInfo(a.sandboxId)).volumeMounts
  try {
    await Volume.destroy(volume.volumeId)
    out.destroyWhileMounted = 'accepted'
  } catch (e) {
    out.destroyWhileMounted = String(e.message).includes('is mounted by sandbox') ? 'refused' : String(e)
  }
} finally {
  await a.kill()
  await b.kill()
}
out.destroyed = await Volume.destroy(volume.volumeId)
console.log(JSON.stringify(out))
