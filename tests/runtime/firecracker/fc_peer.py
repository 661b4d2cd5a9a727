"""A Firecracker API peer for tests: an HTTP server on a unix socket that answers like Firecracker.

It routes and validates every request with the swagger (`fc_swagger`), so a body Firecracker
would refuse is refused here with Firecracker's error shape (`400 {"fault_message": ...}`), and it
keeps Firecracker's small state machine (pre-boot only resources, pause/resume, snapshot create
only while paused, snapshot load only on a fresh process). Snapshot create writes a state file
(JSON of the configuration) and a memory file; snapshot load reads them back, opening every drive
at its recorded path the way Firecracker does. Paths resolve against `root` (the process's working
directory when run as a program).

Disks must be raw images: a drive whose file starts with the qcow2 magic is refused, at
`PUT /drives` and when a snapshot's drives are opened again on load (Firecracker would hand the
guest the qcow2 bytes as its disk; the double fails where that guest would).

Run as a program it stands in for the `firecracker` binary:
`python -m tests.runtime.firecracker.fc_peer --api-sock PATH [--id ID] [...]` (other firecracker
flags are accepted and ignored), which lets the driver's process handling be tested without KVM.
With `AENV_TEST_FC_GUEST=1` in its environment it also runs a guest (`fc_guest.py`: a real envd
behind the VM's tap, on the VM's writable drive) from the moment the VM first runs, paused and
resumed with it; without, no guest runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.network.fakeguest import attach_tap
from tests.runtime.firecracker import fc_guest, fc_swagger
from tests.runtime.firecracker.fc_uffd import GuestMemory

PRE_BOOT_ONLY = {
    ("PUT", "/machine-config"),
    ("PATCH", "/machine-config"),
    ("PUT", "/boot-source"),
    ("PUT", "/drives/{drive_id}"),
    ("PUT", "/network-interfaces/{iface_id}"),
    ("PUT", "/vsock"),
    ("PUT", "/balloon"),
    ("PUT", "/entropy"),
    ("PUT", "/mmds/config"),
    ("PUT", "/serial"),
}
STATE_MAGIC = "aenv-test-firecracker-state"
QCOW2_MAGIC = b"QFI\xfb"
GUEST_ENV = "AENV_TEST_FC_GUEST"
PAGE = 4096
RECORD_PATH = "/_test/requests"
TOUCHED_PATH = "/_test/touched"  # what the "vCPU" of a `Uffd` load read: {offset: hex}
FAIL_PATH = "/_test/fail"


@dataclass
class Recorded:
    method: str
    path: str
    body: Any


@dataclass
class PeerState:
    root: Path
    vm_id: str = "anonymous-instance"
    version: str = "1.17.0"
    state: str = "Not started"
    config: dict[str, Any] = field(default_factory=dict)
    mmds: dict[str, Any] | None = None
    requests: list[Recorded] = field(default_factory=list)
    # (METHOD, path) -> (status, fault message) to answer instead of handling the request.
    fail: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)
    # ... only when the request body equals this one.
    fail_body: dict[tuple[str, str], Any] = field(default_factory=dict)
    loaded_from_snapshot: bool = False
    generation: int = 0
    # Run a guest (`fc_guest.py`) while the VM runs; `guest` is its process once started.
    with_guest: bool = False
    guest: subprocess.Popen[str] | None = None
    # Guest memory of a `Uffd` load (`fc_uffd.py`), and what its "vCPU" read once running: the
    # first page and the newest generation's page (`touched`, by offset).
    memory: GuestMemory | None = None
    touched: dict[int, bytes] = field(default_factory=dict)

    def host(self, path: str) -> Path:
        return self.root / path

    def bodies(self, method: str, path: str) -> list[Any]:
        return [r.body for r in self.requests if r.method == method and r.path == path]


def fault(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"fault_message": message}, status_code=status)


class Peer:
    def __init__(self, state: PeerState) -> None:
        self.state = state
        self.swagger = fc_swagger.load()
        self.app = Starlette(routes=[Route("/{path:path}", self.handle, methods=_METHODS)])

    async def handle(self, request: Request) -> Response:
        method, path = request.method, request.url.path
        # Not Firecracker's: let a test read what a process received, or make a route fail.
        if path == RECORD_PATH:
            return JSONResponse([vars(r) for r in self.state.requests])
        if path == TOUCHED_PATH:
            return JSONResponse({str(k): v.hex() for k, v in list(self.state.touched.items())})
        if path == FAIL_PATH:
            rule = json.loads(await request.body())
            key = (rule["method"], rule["path"])
            self.state.fail[key] = (rule["status"], rule["message"])
            if "body" in rule:
                self.state.fail_body[key] = rule["body"]
            return Response(status_code=204)
        raw = await request.body()
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError as exc:
                return fault(f"An error occurred when deserializing the json body: {exc}")
        self.state.requests.append(Recorded(method, path, body))
        key = (method, path)
        if key in self.state.fail and self.state.fail_body.get(key, body) == body:
            status, message = self.state.fail[key]
            return fault(message, status)
        found = self.swagger.operation(method, path)
        if found is None:
            return fault(f"Invalid request method and/or path: {method} {path}.")
        op, params = found
        if method == "GET" and raw:
            return fault("GET request cannot have a body.")
        if op.body_definition is not None:
            if body is None and op.body_required:
                return fault(f"Empty {method} request.")
            if body is not None:
                errors = self.swagger.errors(op.body_definition, body)
                if errors:
                    return fault(f"{op.body_definition}: {'; '.join(errors)}")
        for param, value in params.items():
            if not value or not all(c == "_" or c.isalnum() for c in value):
                return fault(
                    "API Resource IDs can only contain alphanumeric characters and underscores."
                )
            if isinstance(body, dict) and body.get(param, value) != value:
                return fault(f"The id from the path [{value}] does not match the id from the body!")
        if self.state.state != "Not started" and (method, op.template) in PRE_BOOT_ONLY:
            return fault("The requested operation is not supported after starting the microVM.")
        return self.dispatch(method, op.template, params, body)

    def dispatch(self, method: str, template: str, params: dict[str, str], body: Any) -> Response:
        st = self.state
        cfg = st.config
        if method == "GET":
            return self.get(template)
        if template == "/actions":
            if body["action_type"] == "InstanceStart":
                if st.state != "Not started":
                    return fault("The microVM is already running.")
                if "boot-source" not in cfg:
                    return fault("Cannot start microvm without kernel configuration.")
                if "machine-config" not in cfg:
                    # Firecracker would boot 1 vCPU and 128 MiB; aenv always says what it wants.
                    return fault("This test peer needs PUT /machine-config before InstanceStart.")
                st.state = "Running"
                return self.run_guest()
            return Response(status_code=204)
        if template == "/vm":
            if st.state == "Not started":
                return fault("The requested operation is not supported before starting the VM.")
            st.state = "Running" if body["state"] == "Resumed" else "Paused"
            return self.run_guest()
        if template == "/snapshot/create":
            return self.create_snapshot(body)
        if template == "/snapshot/load":
            return self.load_snapshot(body)
        if template == "/drives/{drive_id}":
            drives = cfg.setdefault("drives", {})
            if method == "PUT":
                problem = _drive_problem(st.host(body["path_on_host"]))
                if problem:
                    return fault(f"Unable to use drive file {body['path_on_host']}: {problem}")
                drives[params["drive_id"]] = body
            elif params["drive_id"] not in drives:
                return fault(f"Invalid block device ID: {params['drive_id']}")
            else:
                drives[params["drive_id"]] = {**drives[params["drive_id"]], **body}
            return Response(status_code=204)
        if template == "/boot-source":
            for key in ("kernel_image_path", "initrd_path"):
                if key in body and not st.host(body[key]).is_file():
                    return fault(f"Cannot load kernel/initrd: {body[key]} not found")
            cfg["boot-source"] = body
            return Response(status_code=204)
        if template == "/network-interfaces/{iface_id}":
            ifaces = cfg.setdefault("network-interfaces", {})
            if method == "PATCH" and params["iface_id"] not in ifaces:
                return fault(f"Invalid interface ID: {params['iface_id']}")
            ifaces[params["iface_id"]] = {**ifaces.get(params["iface_id"], {}), **body}
            return Response(status_code=204)
        if template == "/mmds":
            if method == "PUT" or st.mmds is None:
                st.mmds = dict(body or {})
            else:
                st.mmds.update(body or {})
            return Response(status_code=204)
        name = template.strip("/").replace("/", "-")
        cfg[name] = {**cfg.get(name, {}), **(body or {})} if method == "PATCH" else body
        return Response(status_code=204)

    def get(self, template: str) -> Response:
        st = self.state
        if template == "/":
            return JSONResponse(
                {
                    "app_name": "Firecracker",
                    "id": st.vm_id,
                    "state": st.state,
                    "vmm_version": st.version,
                }
            )
        if template == "/version":
            return JSONResponse({"firecracker_version": st.version})
        if template == "/mmds":
            if st.mmds is None:
                return fault("The MMDS data store is not initialized.", 404)
            return JSONResponse(st.mmds)
        if template == "/balloon":
            if "balloon" not in st.config:
                return fault("Balloon device not configured.")
            return JSONResponse(st.config["balloon"])
        if template == "/balloon/statistics":
            interval = st.config.get("balloon", {}).get("stats_polling_interval_s", 0)
            if not interval:
                return fault("Statistics are not enabled.")
            mib = st.config["balloon"]["amount_mib"]
            return JSONResponse(
                {
                    "target_pages": mib * 256,
                    "actual_pages": mib * 256,
                    "target_mib": mib,
                    "actual_mib": mib,
                    "free_memory": 100 << 20,
                    "total_memory": st.config["machine-config"]["mem_size_mib"] << 20,
                }
            )
        if template == "/balloon/hinting/status":
            return JSONResponse({"host_cmd": 0})
        if template == "/machine-config":
            return JSONResponse(st.config.get("machine-config", {}))
        return fault(f"GET {template} is not served by this test peer.")

    def create_snapshot(self, body: dict[str, Any]) -> Response:
        st = self.state
        if st.state != "Paused":
            return fault("Cannot create snapshot: the microVM is not paused.")
        mem_mib = st.config["machine-config"]["mem_size_mib"]
        kind = body.get("snapshot_type", "Full")
        if kind == "Diff" and not st.config["machine-config"].get("track_dirty_pages"):
            return fault("Diff snapshots require dirty page tracking in this test peer.")
        # Each snapshot of a VM lineage "dirties" one page: page N holds the digit N, so a diff
        # merged over its base shows every generation's page.
        st.generation += 1
        state_doc = {
            "magic": STATE_MAGIC,
            "version": st.version,
            "config": st.config,
            "generation": st.generation,
        }
        st.host(body["snapshot_path"]).write_text(json.dumps(state_doc))
        with st.host(body["mem_file_path"]).open("wb") as mem:
            mem.truncate(mem_mib << 20)
            if kind == "Full":
                mem.write(b"F" * (mem_mib << 20))
            mem.seek(PAGE * st.generation)
            mem.write(str(st.generation).encode() * PAGE)
        return Response(status_code=204)

    def load_snapshot(self, body: dict[str, Any]) -> Response:
        st = self.state
        if st.state != "Not started" or st.loaded_from_snapshot or _configured(st.config):
            return fault("Loading a microVM snapshot not allowed after configuring boot-specific.")
        try:
            doc = json.loads(st.host(body["snapshot_path"]).read_text())
        except (OSError, ValueError) as exc:
            return fault(f"Load snapshot error: cannot read microVM state: {exc}")
        if doc.get("magic") != STATE_MAGIC:
            return fault("Load snapshot error: invalid snapshot state file (CRC mismatch).")
        backend = body["mem_backend"]
        mem = st.host(backend["backend_path"])
        expected = doc["config"]["machine-config"]["mem_size_mib"] << 20
        if backend["backend_type"] == "Uffd":
            try:
                st.memory = GuestMemory(expected, mem)
            except OSError as exc:
                return fault(f"Load snapshot error: cannot connect to the uffd handler: {exc}")
        elif not mem.is_file() or mem.stat().st_size < expected:
            return fault(f"Load snapshot error: cannot map guest memory {mem}")
        for drive in doc["config"].get("drives", {}).values():
            problem = _drive_problem(st.host(drive["path_on_host"]))
            if problem:
                return fault(f"Load snapshot error: drive {drive['path_on_host']}: {problem}")
        config = doc["config"]
        for override in body.get("network_overrides", []):
            iface = config.get("network-interfaces", {}).get(override["iface_id"])
            if iface is None:
                return fault(f"Load snapshot error: no interface {override['iface_id']}")
            iface["host_dev_name"] = override["host_dev_name"]
        config["machine-config"]["track_dirty_pages"] = bool(body.get("track_dirty_pages"))
        st.config = config
        st.generation = doc["generation"]
        st.loaded_from_snapshot = True
        st.state = "Running" if body.get("resume_vm") else "Paused"
        return self.run_guest()

    def run_guest(self) -> Response:
        """Bring the guest (if this peer runs one) to the VM's state: started the first time the
        VM runs, then paused and resumed with it."""
        st = self.state
        if st.memory is not None and st.state == "Running" and not st.touched:
            threading.Thread(target=self.touch_memory, daemon=True).start()
        if not st.with_guest:
            return Response(status_code=204)
        try:
            if st.guest is None and st.state == "Running":
                st.guest = self.start_guest()
            elif st.guest is not None:
                _tell(st.guest, "resume" if st.state == "Running" else "pause")
        except (OSError, RuntimeError, KeyError, ValueError) as exc:
            return fault(f"The guest failed: {exc}")
        return Response(status_code=204)

    def touch_memory(self) -> None:
        """The guest's first reads of its memory, each stopping this thread (a vCPU) until the
        handler has filled the page."""
        st = self.state
        assert st.memory is not None
        for offset in (0, PAGE * st.generation):
            st.touched[offset] = st.memory.read(offset, PAGE)

    def start_guest(self) -> subprocess.Popen[str]:
        cfg = self.state.config
        writable = [d for d in cfg.get("drives", {}).values() if not d["is_read_only"]]
        if len(writable) != 1:
            raise RuntimeError(f"the guest needs one writable drive, not {len(writable)}")
        iface = cfg["network-interfaces"]["eth0"]
        try:  # opening a missing tap would make a new, unconnected one
            socket.if_nametoindex(iface["host_dev_name"])
        except OSError as exc:
            raise RuntimeError(f"Open tap device failed: no {iface['host_dev_name']} here") from exc
        tap = attach_tap(iface["host_dev_name"])
        argv = [
            *("unshare", "--net", "--", sys.executable, "-m", fc_guest.__name__),
            *("--tap-fd", str(tap), "--mac", iface["guest_mac"]),
            *("--cmdline", cfg["boot-source"]["boot_args"]),
            *("--drive", str(self.state.host(writable[0]["path_on_host"]))),
            *("--scratch", str(self.state.host(f"guest-{self.state.vm_id}"))),
        ]
        try:
            guest = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                pass_fds=[tap],
                preexec_fn=fc_guest.die_with_parent,
            )
        finally:
            os.close(tap)
        _wait_ok(guest)
        return guest


def _drive_problem(path: Path) -> str | None:
    try:
        with path.open("rb") as image:
            magic = image.read(4)
    except OSError as exc:
        return exc.strerror or str(exc)
    return "a qcow2 image; only raw disk images are supported" if magic == QCOW2_MAGIC else None


def _tell(guest: subprocess.Popen[str], command: str) -> None:
    assert guest.stdin is not None
    guest.stdin.write(command + "\n")
    guest.stdin.flush()
    _wait_ok(guest)


def _wait_ok(guest: subprocess.Popen[str]) -> None:
    assert guest.stdout is not None
    answer = guest.stdout.readline().strip()
    if answer != "ok":
        guest.kill()
        raise RuntimeError(f"the guest exited ({guest.wait()}) instead of answering")


def _configured(config: dict[str, Any]) -> bool:
    return any(key not in {"logger", "metrics"} for key in config)


_METHODS = ["GET", "PUT", "PATCH", "POST", "DELETE"]


def make_server(state: PeerState, socket_path: Path) -> uvicorn.Server:
    return uvicorn.Server(
        uvicorn.Config(Peer(state).app, uds=str(socket_path), log_level="warning", lifespan="off")
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-sock", required=True)
    parser.add_argument("--id", default="anonymous-instance")
    args, _ignored = parser.parse_known_args()
    # Like Firecracker: the guest console is our stdout; pid file lets tests find us.
    print(f"test firecracker {os.getpid()} id={args.id}", flush=True)
    state = PeerState(root=Path.cwd(), vm_id=args.id, with_guest=os.environ.get(GUEST_ENV) == "1")
    asyncio.run(make_server(state, Path(args.api_sock)).serve())


if __name__ == "__main__":
    main()
