"""Template builds on the double driver: steps run through the build VM's envd (the double
records commands instead of running them), cached step layers, failures, records that
outlive the builder."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

from e2b.template.utils import calculate_files_hash, tar_file_stream

from aenv.cluster.saved import SavedRecord
from aenv.cluster.source import CatalogSource
from aenv.orchestrator.build_records import Build, BuildSpec, BuildStatus, Step
from aenv.orchestrator.build_steps import StepType, tar_files_hash
from aenv.orchestrator.builds import Builder
from aenv.orchestrator.kinds import SaveMode, TemplateKind
from aenv.orchestrator.tags import TagStore
from aenv.orchestrator.templates import template_from_json
from tests.doubles.guest import COMMANDS
from tests.doubles.node import DoubleNode, double_node
from tests.support.wait import eventually


def builder(node: DoubleNode, cache_layers: int = 8) -> Builder:
    paths = node.config.paths
    return Builder(
        node.orchestrator, TagStore(paths.template_tags), paths, 5, cache_layers=cache_layers
    )


def spec(*steps: tuple[StepType, tuple[str, ...]]) -> BuildSpec:
    return BuildSpec(
        from_template="base", from_image=None, steps=tuple(Step(t, args) for t, args in steps)
    )


async def run(builds: Builder, name: str, build_spec: BuildSpec) -> Build:
    build = builds.request(name, [])
    assert build.template_id in builds.unfinished_templates()
    builds.start(build, build_spec)
    await eventually(lambda: build.status in (BuildStatus.READY, BuildStatus.ERROR))
    assert build.template_id not in builds.unfinished_templates()
    return build


STEPS = spec(
    (StepType.RUN, ("echo one",)),
    (StepType.ENV, ("GREETING", "hi")),
    (StepType.USER, ("root",)),
    (StepType.RUN, ("echo two",)),
)


async def test_build_runs_steps_and_saves_a_template(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        build = await run(builder(node), "app", STEPS)
        assert build.status is BuildStatus.READY, build.reason
        template = node.templates.get("app")
        assert template.kind is TemplateKind.TEMPLATE
        assert (template.env_vars, template.default_user) == ({"GREETING": "hi"}, "root")
        layers = [t for t in node.templates.list_all() if t.kind is TemplateKind.BUILD_LAYER]
        assert len(layers) == 2  # after each RUN
        # Disks only: no guest memory held on tmpfs for a rebuild; the template has its own.
        assert {t.save_mode for t in layers} == {SaveMode.FILESYSTEM}
        assert template.save_mode is SaveMode.FULL
        assert [r for r in node.catalog.list() if r.internal] == []  # the build VM is gone
        assert node.driver.running == {}
        record, _ = await node.orchestrator.create(node.request(template="app"))
        guest = node.guest(record.id)
        ran = (guest.read(COMMANDS) or "").splitlines()
        assert ran[:2] == ["echo one", "id -u root"] and "echo two" in ran
        assert guest.env["GREETING"] == "hi" and guest.default_user == "root"


async def test_rebuild_starts_from_cached_layers(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        builds = builder(node)
        assert (await run(builds, "app", STEPS)).status is BuildStatus.READY
        again = await run(builds, "app", STEPS)
        assert again.status is BuildStatus.READY
        cached = [e.message for e in again.logs.page(0, 1000) if "CACHED" in e.message]
        assert len(cached) == 4  # every step: the last RUN's layer has them all
        changed = await run(builds, "app", spec(*STEPS_PREFIX, (StepType.RUN, ("echo three",))))
        assert [e.message for e in changed.logs.page(0, 1000) if "CACHED" in e.message] == [
            "[1/2] CACHED RUN echo one"
        ]


STEPS_PREFIX = ((StepType.RUN, ("echo one",)),)


async def test_failing_step_ends_the_build_in_error(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        build = await run(builder(node), "broken", spec((StepType.RUN, ("exit 3",))))
        assert build.status is BuildStatus.ERROR
        assert build.reason is not None and build.reason.step == "1"
        assert "exited with code 3" in str(build.reason)
        assert [r for r in node.catalog.list() if r.internal] == []
        assert node.driver.running == {}
        assert all(t.template_id != build.template_id for t in node.templates.list_all())


async def test_a_copy_with_a_hard_link_to_nothing_fails_its_step(tmp_path: Path) -> None:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        tar.addfile(tarfile.TarInfo("a"), io.BytesIO())
        link = tarfile.TarInfo("b")
        link.type, link.linkname = tarfile.LNKTYPE, "missing"
        tar.addfile(link)
    files_hash = hashlib.sha256(data.getvalue()).hexdigest()
    async with double_node(tmp_path) as node:
        builds = builder(node)
        build = builds.request("linked", [])
        uploaded = builds.files.path(build.template_id, files_hash)
        uploaded.parent.mkdir(parents=True)
        uploaded.write_bytes(data.getvalue())
        copy = Step(StepType.COPY, ("*", "/app/"), files_hash=files_hash)
        builds.start(build, BuildSpec("base", None, (copy,)))
        await eventually(lambda: build.status is BuildStatus.ERROR)
        assert build.status is BuildStatus.ERROR
        assert build.reason is not None and build.reason.step == "1"
        assert "COPY *: b is a hard link to missing, which is not a file" in str(build.reason)
        assert node.driver.running == {}


def test_a_hard_link_hashes_as_the_sdk_hashes_it(tmp_path: Path) -> None:
    """The SDK archives a file's second name as a hard link (no content) and hashes it as the
    file: a build must get the same hash, or its COPY fails as a mismatch."""
    (tmp_path / "a").write_text("hello\n")
    os.link(tmp_path / "a", tmp_path / "b")
    uploaded = tmp_path / "upload.tar.gz"
    with tar_file_stream("*", str(tmp_path), [], False, True) as archive:
        uploaded.write_bytes(archive.read())
    with tarfile.open(uploaded) as tar:
        assert tar.getmember("b").islnk()
    expected = calculate_files_hash("*", "/app/", str(tmp_path), ["upload.tar.gz"], False, None)
    assert tar_files_hash(uploaded, "*", "/app/") == expected


async def test_build_records_outlive_the_builder(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        first = builder(node)
        done = await run(first, "app", spec((StepType.RUN, ("exit 1",))))
        waiting = first.request("later", [])
        again = builder(node)  # as after a restart
        loaded = again.get(done.template_id, done.build_id)
        assert loaded is not None and loaded.status is BuildStatus.ERROR
        assert loaded.logs.page(0, 1000) == done.logs.page(0, 1000) != []
        interrupted = again.get(waiting.template_id, waiting.build_id)
        assert interrupted is not None and interrupted.status is BuildStatus.ERROR
        assert "interrupted" in str(interrupted.reason)


async def test_old_cached_layers_are_dropped(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        builds = builder(node, cache_layers=1)
        for word in ("a", "b"):
            assert (
                await run(builds, word, spec((StepType.RUN, (word,))))
            ).status is BuildStatus.READY
        layers = [
            t
            for t in node.templates.list_all()
            if t.kind is TemplateKind.BUILD_LAYER and not t.deleted
        ]
        assert len(layers) == 1


async def test_a_build_is_stored_in_the_repository_before_it_is_ready(tmp_path: Path) -> None:
    """In a cluster, ready means any node can start it: another node adopts the stored copy."""
    shared = str(tmp_path / "repository")
    cluster = "redis://127.0.0.1:1/0"  # a cluster node's copies carry their images; never dialled
    async with (
        double_node(tmp_path / "a", redis_url=cluster, repository=shared) as a,
        double_node(tmp_path / "b", redis_url=cluster, repository=shared) as b,
    ):
        builds = builder(a)
        build = await run(builds, "app", STEPS)
        assert build.status is BuildStatus.READY, build.reason
        template = a.templates.get("app")
        assert template.manifest_id is not None
        assert any(
            "Stored in the snapshot repository" in e.message for e in build.logs.page(0, 1000)
        )
        # Published with its tags, which the node adopting it keeps (`api.handoff`).
        builds.tags.assign(template.template_id, ["v1"], build.build_id)
        state = await CatalogSource(a.catalog, a.templates, builder=builds).state()
        published = SavedRecord.of(state.saved[template.template_id])
        assert published.tags == {"latest": build.build_id, "v1": build.build_id}
        assert template_from_json(published.record) == template
        theirs = TagStore(b.config.paths.template_tags)
        theirs.take(template.template_id, published.tags)
        assert theirs.builds(template.template_id) == published.tags
        adopted = await b.orchestrator.adopt_template(template)
        assert adopted.snapshot_dir.startswith(str(b.config.home))
        record, _ = await b.orchestrator.create(b.request(template="app"))
        assert b.guest(record.id).env["GREETING"] == "hi"


async def test_a_reserved_build_is_taken_over_by_the_next_request(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        builds = builder(node)
        reserved = builds.reserve("app")
        assert builds.unfinished("app") is reserved  # creates hear "has no ready build"
        taken = builds.request("app", ["v1"], cpu_count=2)
        assert taken is reserved and (taken.tags, taken.cpu_count) == (("v1",), 2)
        builds.abandon(reserved, "too late")  # taken over: nothing to end
        assert reserved.status is BuildStatus.WAITING and reserved.reason is None
        assert builds.request("app", []) is not reserved  # reserved once, taken once
        builds.start(taken, STEPS)
        await eventually(lambda: taken.status is BuildStatus.READY)


async def test_a_reserved_build_never_requested_ends_in_error(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        builds = builder(node)
        reserved = builds.reserve("app")
        builds.abandon(reserved, "publishing stopped before the build was requested")
        assert reserved.status is BuildStatus.ERROR and builds.unfinished("app") is None
        assert "publishing stopped" in str(reserved.reason)
        assert builder(node).builds_of("app")[0].status is BuildStatus.ERROR  # recorded
