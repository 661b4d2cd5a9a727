// The npm `e2b` SDK against a real aenv server: pause, connect (resume), auto-pause on timeout,
// snapshots (create, list, create from, delete) and fork. Prints one JSON object.
import { Sandbox } from 'e2b'

const out = {}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const sbx = await Sandbox.create({ timeoutMs: 300_000 })
const made = []
try {
  await sbx.files.write('/home/user/js.txt', 'kept')
  out.paused = await sbx.pause()
  out.pausedAgain = await sbx.pause()
  out.stateWhilePaused = (await Sandbox.getInfo(sbx.sandboxId)).state
  const resumed = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 })
  out.readAfterResume = await resumed.files.read('/home/user/js.txt')

  const snap = await resumed.createSnapshot({ name: 'js-snapshot' })
  out.snapshotNames = snap.names
  const listed = await Sandbox.listSnapshots().nextItems()
  out.snapshotListed = listed.map((s) => s.snapshotId).includes(snap.snapshotId)
  const child = await Sandbox.create(snap.snapshotId, { timeoutMs: 60_000 })
  made.push(child)
  out.readFromSnapshot = await child.files.read('/home/user/js.txt')

  const forks = await resumed.fork({ count: 2, timeoutMs: 60_000 })
  for (const f of forks) if (!(f instanceof Error)) made.push(f)
  out.forked = forks.filter((f) => !(f instanceof Error)).length
  out.forkRead = await Promise.all(
    forks.filter((f) => !(f instanceof Error)).map((f) => f.files.read('/home/user/js.txt'))
  )
  out.snapshotDeleted = await Sandbox.deleteSnapshot(snap.snapshotId)

  const auto = await Sandbox.create({ timeoutMs: 3_000, lifecycle: { onTimeout: 'pause' } })
  made.push(auto)
  let state = 'running'
  for (let i = 0; i < 120 && state !== 'paused'; i++) {
    await sleep(500)
    state = (await Sandbox.getInfo(auto.sandboxId)).state
  }
  out.autoPaused = state
  out.autoResumed = (await Sandbox.connect(auto.sandboxId, { timeoutMs: 60_000 })).sandboxId === auto.sandboxId
} finally {
  for (const s of made) await s.kill()
  out.killed = await sbx.kill()
}
console.log(JSON.stringify(out))
