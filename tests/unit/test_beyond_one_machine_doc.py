"""docs/design.md, "Beyond one machine", against the code: the sbatch script shown is the
one ``launch --slurm`` writes for the README's two-node example, every config key the
section names exists, and the Kubernetes objects' commands parse with the real parsers
(the learner's overrides load, the actors' are host-local keys)."""

from __future__ import annotations

import re
import shlex

import yaml

from arpo_async.core.config import Config, _members, load_config
from arpo_async.launch import _parser as launch_parser
from arpo_async.launcher.remote import HOST_LOCAL_KEYS
from arpo_async.launcher.remote import _parser as actor_parser
from arpo_async.launcher.slurm import job_config, layout, sbatch_script
from tests.conftest import REPO

DESIGN, README = REPO / "docs" / "design.md", REPO / "README.md"
EXAMPLE = ["--slurm", "--nodes-learner", "1", "--nodes-actors", "1", "--emit",
           "runs/two_node/slurm.sbatch", "--config", "configs/spine.yaml",
           "run.dir=runs/two_node", "actors.num=2", "transport.trajectory_port=29610",
           "transport.control_port=29611"]


def _section() -> str:
    text = DESIGN.read_text()
    start = text.index("\n## Beyond one machine\n")
    return text[start:text.index("\n## ", start + 1)]


def _blocks(text: str) -> list[str]:
    parts = text.split("```")
    return [parts[i].split("\n", 1)[1] for i in range(1, len(parts), 2)]


def _key_exists(dotted: str) -> bool:
    """A key of the config: through sections and any member of a tagged union."""
    models = (Config,)
    for part in dotted.split("."):
        found = [m.model_fields[part].annotation for m in models
                 if part in getattr(m, "model_fields", {})]
        if not found:
            return False
        models = tuple(c for a in found for c in (_members(a) or (a,)))
    return True


def test_the_doc_shows_the_script_the_code_writes():
    args = launch_parser().parse_args(EXAMPLE)
    cfg = load_config(REPO / args.config, args.overrides)
    script = sbatch_script(job_config(cfg), layout(cfg, args.nodes_learner, args.nodes_actors),
                           "python", "/shared/arpo_async")
    assert script in _blocks(_section()), "docs/design.md shows a stale sbatch script"
    command = "python -m arpo_async.launch " + shlex.join(EXAMPLE)
    readme = " ".join(README.read_text().split())
    assert command.replace("--emit runs/two_node/slurm.sbatch ", "") in readme


def test_every_config_key_the_section_names_exists():
    """In its prose (the code blocks are checked by running them)."""
    sections = set(Config.model_fields)
    prose = "".join(_section().split("```")[::2])
    named = {m.group(1) for m in re.finditer(r"\b([a-z_]+(?:\.[a-z_]+)+)\b", prose)
             if m.group(1).split(".")[0] in sections}
    assert len(named) >= 15, named
    missing = sorted(k for k in named if not _key_exists(k))
    assert not missing, missing


def test_the_kubernetes_commands_parse_and_load():
    objects = [o for b in _blocks(_section()) if "apiVersion" in b
               for o in yaml.safe_load_all(b)]
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["Deployment", "Job", "PersistentVolumeClaim", "Service"], kinds
    commands = {o["kind"]: o["spec"]["template"]["spec"]["containers"][0]["command"]
                for o in objects if o["kind"] in ("Job", "Deployment")}
    learner = commands["Job"]
    assert learner[:3] == ["python", "-m", "arpo_async.launch"]
    args = launch_parser().parse_args(learner[3:])
    cfg = load_config(REPO / args.config, args.overrides)  # every key exists and validates
    assert cfg.actors.num == 0 and cfg.cluster.remote_actors[0].actors == 4
    replicas = next(o for o in objects if o["kind"] == "Deployment")["spec"]["replicas"]
    assert replicas == cfg.cluster.remote_actors[0].actors
    actor = commands["Deployment"]
    assert actor[:4] == ["python", "-m", "arpo_async.launch", "actor"]
    parsed = actor_parser().parse_args(actor[4:])
    port = parsed.connect.rsplit(":", 1)[1]
    assert int(port) == cfg.transport.control_port
    assert all(o.split("=")[0] in HOST_LOCAL_KEYS for o in parsed.overrides), parsed.overrides
