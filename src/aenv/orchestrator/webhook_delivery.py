"""Webhook deliveries: the queued events POSTed to their webhooks, signed as E2B signs them,
at least once, in order, in the background.

One task per webhook with pending deliveries sends them one at a time, oldest event first,
so a receiver sees each sandbox's events in order. A delivery:
1. Resolves the webhook's host and refuses the target when any of its addresses is one a
   sandbox could not reach (`allowed`: the node's private network, loopback, link-local,
   other sandboxes), unless the operator allows internal targets: a webhook must not be a
   way into the node's network. The request then goes to the addresses checked, one after
   the other until one connects (the name stays in `Host` and TLS's SNI), so a second lookup
   cannot point it elsewhere.
2. POSTs the event's JSON with `e2b-webhook-id`, `e2b-delivery-id`, `e2b-signature-version`
   (`v1`) and `e2b-signature`: the unpadded URL-safe base64 SHA-256 of the webhook's secret
   followed by the body. The delivery id is new at every attempt, as E2B's docs define it
   ("unique ID for the delivery attempt"); what stays the same across a delivery's attempts
   is the event's `id`, which receivers dedupe on.
3. A 2xx answer delivers it. Any other outcome is tried again after `retry_delay`, doubled
   each time, until `attempts` ran out (`failed`); a refused target fails at once.
Each outcome is written to the delivery's row (the log). An event is queued in its
operation's transaction (`events`), and a delivery cut short by a restart is still pending:
the next start sends it again. Operations never wait for any of it.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import ipaddress
import logging
import socket
import ssl
import uuid
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address

import httpx

from aenv.orchestrator.webhooks import Delivery, DeliveryState, Webhook, WebhookStore

log = logging.getLogger("aenv.orchestrator")

SIGNATURE_VERSION = "v1"


def signature(secret: str, body: str) -> str:
    """E2B's `e2b-signature` of `body`."""
    digest = hashlib.sha256((secret + body).encode()).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


@dataclass(frozen=True)
class DeliverySettings:
    attempts: int
    retry_delay: float
    timeout: float
    # Internal targets (private, loopback, ...) allowed: the operator's choice, and tests'.
    internal_allowed: bool
    # What no sandbox may reach (`SlotProvider.denied`).
    denied: tuple[IPv4Network, ...]


class TargetRefused(ValueError):
    """A webhook's target is an address a sandbox could not reach."""


def allowed(address: IPv4Address | IPv6Address, settings: DeliverySettings) -> None:
    """Raises `TargetRefused` when a delivery may not go to `address`. Guests have no IPv6
    path: an IPv6 target must at least be a global one."""
    if settings.internal_allowed:
        return
    if isinstance(address, IPv6Address):
        if address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        elif not address.is_global:
            raise TargetRefused(f"{address} is not a global address")
    if isinstance(address, IPv4Address) and any(address in net for net in settings.denied):
        raise TargetRefused(f"{address} is in a range sandboxes cannot reach")


def parse_url(url: str) -> httpx.URL:
    """A webhook URL; `ValueError` unless it is http(s) with a host."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError("a webhook URL is http:// or https:// with a host")
    return parsed


def check_url(url: str, settings: DeliverySettings) -> None:
    """Raises `TargetRefused` (or `ValueError`) for a webhook URL that can never be
    delivered to: not http(s), no host, or a literal address `allowed` refuses. A name is
    judged at each delivery, by what it resolves to then."""
    parsed = parse_url(url)
    try:
        literal = ipaddress.ip_address(parsed.host)
    except ValueError:
        return  # a name
    allowed(literal, settings)


async def _resolve(url: httpx.URL, settings: DeliverySettings) -> list[str]:
    """Step 1: the addresses to send to, every one judged; IPv4 first (a host without an IPv6
    route would fail every delivery to a name that lists IPv6 first), else in the resolver's
    order."""
    port = url.port or (443 if url.scheme == "https" else 80)
    infos = await asyncio.get_running_loop().getaddrinfo(url.host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
    if not addresses:
        raise OSError(f"{url.host} has no address")
    for address in addresses:
        allowed(address, settings)
    return [str(a) for a in sorted(addresses, key=lambda a: a.version)]


@functools.cache
def _system_trust() -> ssl.SSLContext:
    """The host's CA store, loaded once per process: 30-50 ms of CPU a load, once for each
    dispatcher made otherwise (every node a test starts). Read-only once made, so shared."""
    return ssl.create_default_context()


class WebhookDispatcher:
    def __init__(self, store: WebhookStore, settings: DeliverySettings) -> None:
        self.store = store
        self.settings = settings
        # Not the host's proxy: the request goes to the address judged (step 1).
        self.client = httpx.AsyncClient(
            verify=_system_trust(), trust_env=False, follow_redirects=False
        )
        self.workers: dict[str, asyncio.Task[None]] = {}
        self.closed = False

    def wake(self) -> None:
        """Start a task for each webhook with pending deliveries that has none."""
        if self.closed:
            return
        for webhook_id in self.store.with_pending():
            if webhook_id not in self.workers:
                task = asyncio.get_running_loop().create_task(self._work(webhook_id))
                self.workers[webhook_id] = task
                task.add_done_callback(functools.partial(self._ended, webhook_id))

    def _ended(self, webhook_id: str, task: asyncio.Task[None]) -> None:
        if self.workers.get(webhook_id) is task:
            del self.workers[webhook_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("deliveries of webhook %s failed", webhook_id, exc_info=task.exception())

    async def close(self) -> None:
        """Stop sending; what is pending stays queued for the next start."""
        self.closed = True
        workers = list(self.workers.values())
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await self.client.aclose()

    async def _work(self, webhook_id: str) -> None:
        while True:
            hook = self.store.by_id(webhook_id)
            if hook is None or not hook.enabled:
                return
            delivery = self.store.next(webhook_id)
            if delivery is None:
                return
            await self._deliver(hook, delivery)

    async def _deliver(self, hook: Webhook, delivery: Delivery) -> None:
        attempts = delivery.attempts
        while True:
            attempts += 1
            status, error, final = await self._attempt(hook, delivery)
            if error is None:
                self.store.attempted(delivery.id, DeliveryState.DELIVERED, attempts, status, None)
                return
            if final or attempts >= self.settings.attempts:
                log.warning("webhook %s: delivery %s failed: %s", hook.id, delivery.id, error)
                self.store.attempted(delivery.id, DeliveryState.FAILED, attempts, status, error)
                return
            self.store.attempted(delivery.id, DeliveryState.PENDING, attempts, status, error)
            await asyncio.sleep(self.settings.retry_delay * 2 ** (attempts - 1))
            current = self.store.by_id(hook.id)
            if current is None or not current.enabled:
                return  # deleted (its queue with it) or disabled (kept for its return)
            hook = current

    async def _attempt(
        self, hook: Webhook, delivery: Delivery
    ) -> tuple[int | None, str | None, bool]:
        """Steps 1-2: the answer's status (None: no answer), the error (None: delivered) and
        whether trying again is pointless."""
        try:
            url = httpx.URL(hook.url)
            addresses = await _resolve(url, self.settings)
        except (TargetRefused, ValueError) as e:
            return None, f"refused: {e}", True
        except OSError as e:
            return None, f"cannot resolve {hook.url}: {e}", False
        headers = {
            "Host": url.netloc.decode("ascii"),
            "Content-Type": "application/json",
            "e2b-webhook-id": hook.id,
            "e2b-delivery-id": str(uuid.uuid4()),  # one per attempt, as E2B's
            "e2b-signature-version": SIGNATURE_VERSION,
            "e2b-signature": signature(hook.secret, delivery.body),
        }
        unreached: httpx.ConnectError | None = None
        for address in addresses:
            try:
                response = await self.client.post(
                    url.copy_with(host=address),
                    content=delivery.body.encode(),
                    headers=headers,
                    extensions={"sni_hostname": url.host} if url.scheme == "https" else {},
                    timeout=self.settings.timeout,
                )
            except httpx.ConnectError as e:
                unreached = e  # the name's next address, as any client falls back
                continue
            except httpx.HTTPError as e:
                return None, f"{type(e).__name__}: {e}", False
            if response.is_success:
                return response.status_code, None, False
            return response.status_code, f"answered {response.status_code}", False
        return None, f"{type(unreached).__name__}: {unreached}", False
