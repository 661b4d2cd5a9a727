// The npm `e2b` SDK's network options against a real aenv server reached by its domain alone
// (E2B_DOMAIN, E2B_API_KEY and NODE_EXTRA_CA_CERTS set by the caller), with the simulated
// internet's two web servers at the addresses given as arguments, then its SOCKS5 proxy's
// address, username and password. Prints one JSON object.
import { Sandbox } from 'e2b'

const [A, B, SOCKS, USER, PASSWORD] = process.argv.slice(2)

async function reached(sbx) {
  const got = []
  for (const address of [A, B]) {
    const run = await sbx.commands.run(`curl -s -m 3 http://${address}/ || true`)
    if (run.stdout.trim() === address) got.push(address)
  }
  return got
}

const out = {}
const sbx = await Sandbox.create({
  timeoutMs: 120_000,
  network: { allowOut: [A], denyOut: ['0.0.0.0/0'] },
})
try {
  out.created = await reached(sbx)
  const info = await sbx.getInfo()
  out.info = { allowOut: info.network.allowOut, denyOut: info.network.denyOut }
  await sbx.updateNetwork({ denyOut: [A] })
  out.updated = await reached(sbx)
  await sbx.updateNetwork({})
  out.cleared = await reached(sbx)
  const proxy = { address: SOCKS, username: USER, password: PASSWORD }
  await sbx.updateNetwork({ denyOut: [B], egressProxy: proxy })
  out.proxied = await reached(sbx)
  out.proxyInfo = (await sbx.getInfo()).network.egressProxy
  await sbx.updateNetwork({ egressProxy: { ...proxy, password: 'wrong' } })
  out.refused = await reached(sbx)
} finally {
  await sbx.kill()
}

const priv = await Sandbox.create({ timeoutMs: 60_000, network: { allowPublicTraffic: false } })
try {
  out.token = typeof priv.trafficAccessToken === 'string' && priv.trafficAccessToken.length > 0
  // Nothing listens on the port: with the token the proxy gets as far as the sandbox (502).
  const url = `https://${priv.getHost(8000)}/`
  out.without = (await fetch(url)).status
  const headers = { 'e2b-traffic-access-token': priv.trafficAccessToken }
  out.with = (await fetch(url, { headers })).status
} finally {
  await priv.kill()
}
const https = await Sandbox.create({ timeoutMs: 60_000, network: { httpsPorts: [8443] } })
try {
  out.httpsPorts = (await https.getInfo()).network.httpsPorts
} finally {
  await https.kill()
}
console.log(JSON.stringify(out))
