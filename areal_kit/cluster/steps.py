"""Provisioning steps before Ray: connect, preflight, storage, install, image (built by cluster/image.py).

Each step checks first and acts only when needed (a re-run after a fix redoes only what is
missing) and returns an Outcome: ok (nothing to do), changed (acted), skipped (not
applicable), or raises StepFailed naming the command and what to do. Every command is built
with shlex quoting (`q`), so hostnames, paths and image names cannot inject shell code.
"""

from __future__ import annotations

import shlex

from areal_kit import hardware, stack
from areal_kit.cluster import gpu_stack
from areal_kit.cluster import image as own_image
from areal_kit.cluster.context import Cluster, HostState, Outcome
from areal_kit.cluster.options import q
from areal_kit.cluster.parallel import StepFailed
from areal_kit.cluster.remote import ConnectError, Result

APT_ENV = "DEBIAN_FRONTEND=noninteractive"
NVIDIA_REPO = (
    "curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey | gpg --batch --yes --dearmor "
    "-o /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg && "
    "curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list"
    " | sed 's#deb https://#deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg]"
    " https://#g' > /etc/apt/sources.list.d/nvidia-container-toolkit.list"
)


def fail(c: Cluster, message: str, res: Result | None = None) -> None:
    """Raise StepFailed, except in a dry run (no output to judge: keep listing commands)."""
    if not c.opts.dry_run:
        raise StepFailed(message, res)


def must(c: Cluster, h: HostState, cmd: str, what: str, sudo: bool = False,
         timeout: float | None = None) -> Result:
    res = h.remote.run(cmd, sudo=sudo, timeout=timeout)
    if not res.ok:
        fail(c, f"{what} failed (exit {res.rc})", res)
    return res


def docker(h: HostState, *args: object) -> str:
    return q("docker", *args)


# -- 1. connect -------------------------------------------------------------------------------
def connect(c: Cluster, h: HostState) -> Outcome:
    try:
        h.ip = h.remote.connect()
    except ConnectError as e:
        raise StepFailed(f"{e.kind}: {e}") from None
    if c.secrets:
        # Secrets travel over SFTP into a 0600 file, never on a command line (ps, logs).
        body = "".join(f"{k}={v}\n" for k, v in c.secrets.items())
        h.remote.put_text(body, c.opts.secrets_path(h.remote.user), 0o600)
    return Outcome("ok", f"{h.remote.user}@{h.spec.label}, node address {h.ip}")


# -- 2. preflight -----------------------------------------------------------------------------
# The host's GPUs as nvidia-smi -L lists them, outside any container: "gpus=8", or "gpus=none"
# without nvidia-smi. Preflight's count, and doctor's where setup did not run before it.
GPU_COUNT = ("if command -v nvidia-smi >/dev/null 2>&1; then echo gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); "
             "else echo gpus=none; fi")


def parse_gpu_count(stdout: str) -> int:
    """GPU_COUNT's answer as a number (0 for none)."""
    raw = next((ln.split("=", 1)[1].strip() for ln in stdout.splitlines() if ln.startswith("gpus=")), "none")
    return int(raw) if raw.isdigit() else 0


# nvidia-smi's GPUs, a "smi=name, MiB, driver" line each (doctor's query), and its exit code: a
# driver that does not answer is told apart from a host without GPUs.
SMI = (f"if command -v nvidia-smi >/dev/null 2>&1; then out=$({shlex.join(hardware.GPU_QUERY)} 2>&1); "
       "echo smi_rc=$?; printf '%s\\n' \"$out\" | sed 's/^/smi=/'; fi")

# What setup's own steps need on a host, by the command that provides it: the Debian package the
# install (or storage) step puts there with apt where it is missing, and what to install by hand
# on a host without apt (RHEL/CentOS, SUSE): preflight names those before anything is done.
TOOLS = {
    "docker": ("docker.io", "docker (docker-ce from Docker's repository; systemctl enable --now docker)"),
    "git-lfs": ("git-lfs", "git-lfs"),
    "nvidia-ctk": ("nvidia-container-toolkit", ("nvidia-container-toolkit (NVIDIA's repository; then "
                                                "nvidia-ctk runtime configure --runtime=docker and restart docker)")),
    "mount.nfs": ("nfs-common", "nfs-utils"),
}
_HAS = "has() { command -v \"$1\" >/dev/null 2>&1 || [ -x \"/sbin/$1\" ] || [ -x \"/usr/sbin/$1\" ]; }"


def needed_tools(c: Cluster, gpus: int) -> list[str]:
    """The TOOLS a host needs for this setup: docker and git-lfs for the docker runtime, the NVIDIA
    container toolkit where it has GPUs, mount.nfs with --nas-url."""
    o = c.opts
    need = ["docker", "git-lfs", *(["nvidia-ctk"] if gpus else [])] if o.runtime == "docker" else []
    return need + (["mount.nfs"] if o.nas_url else [])


def by_hand(host: str, facts: dict, missing: list[str]) -> str:
    """The one line for a host without apt-get that lacks some TOOLS."""
    mgr = facts.get("pkg", "none")
    how = f"with {mgr}" if mgr != "none" else "(no package manager found)"
    return (f"{host} ({facts.get('os', '?').strip()}) has no apt-get, so setup cannot install what it needs; "
            f"install by hand {how}: {'; '.join(TOOLS[t][1] for t in missing)}; then run setup again")


def _facts_script(storage: str, tools: list[str]) -> str:
    s = shlex.quote(storage)
    return "; ".join([
        ". /etc/os-release 2>/dev/null; echo \"os=${ID:-unknown} ${VERSION_ID:-}\"",
        "echo arch=$(uname -m)",
        ("if [ \"$(id -u)\" = 0 ]; then echo sudo=root; elif command -v sudo >/dev/null 2>&1; then "
         "if sudo -n true 2>/dev/null; then echo sudo=yes; else echo sudo=nopasswd-missing; fi; "
         "else echo sudo=not-installed; fi"),
        GPU_COUNT,
        (f"if [ -d {s} ]; then echo disk_gb=$(df -Pk {s} | awk 'NR==2{{printf \"%.1f\", $4/1048576}}'); "
         "else echo disk_gb=missing; fi"),
        "command -v apt-get >/dev/null 2>&1 && echo apt=yes || echo apt=no",
        "echo pkg=$(for m in apt-get dnf yum zypper pacman apk; do command -v $m >/dev/null 2>&1 && echo $m && break; done)",
        *([_HAS, f"for t in {' '.join(tools)}; do has $t && echo has_$t=yes || echo has_$t=no; done"] if tools else []),
        SMI,
    ])


def read_facts(stdout: str) -> tuple[dict, list[dict], str]:
    """The facts script's key=value lines, nvidia-smi's GPUs (gpu_stack.parse_gpu_query's) and, where
    nvidia-smi ran and failed, what it said ("" when it answered or is not there)."""
    facts: dict = {}
    smi: list[str] = []
    for line in stdout.splitlines():
        if line.startswith("smi="):
            smi.append(line[4:])
        elif "=" in line:
            k, v = line.split("=", 1)
            facts[k] = v
    facts["pkg"] = facts.get("pkg") or "none"
    rc = facts.pop("smi_rc", "0")
    failed = "" if rc == "0" else (next((ln.strip() for ln in smi if ln.strip()), "") or f"exit {rc}")
    return facts, gpu_stack.parse_gpu_query("\n".join(smi)), failed


def driver_check(c: Cluster, host: str, gpus: list[dict]) -> tuple[str, str]:
    """(refusal, note) for the NVIDIA driver against the CUDA of the image setup builds: areal-kit's
    own (stack.py's CUDA, which its pinned wheels are built for); an image of the user's or the host
    runtime's Python is checked by doctor, inside it."""
    driver = min((g["driver"] for g in gpus), key=lambda d: gpu_stack.driver_major(d) or 0, default="")
    if not driver:
        return "", ""
    o = c.opts
    own_cuda = o.runtime == "docker" and o.image is None and \
        dict(a.split("=", 1) for a in o.build_args).get("ACCELERATOR", "cuda") == "cuda"
    if not own_cuda:
        return "", f", driver {driver} (doctor checks it against the runtime's CUDA)"
    cuda = stack.versions("cuda")["cuda"]
    need = gpu_stack.driver_needed(driver, cuda)
    if need is None:
        return "", f", driver {driver} (CUDA {cuda} needs >= {stack.min_driver(cuda)})"
    return (f"NVIDIA driver {driver} on {host} is too old for areal-kit's image: CUDA {cuda} needs >= {need} (the pinned "
            f"torch {stack.TORCH} and vLLM {stack.VLLM} are CUDA {cuda} builds, so no --build-arg makes an image "
            f"for driver {gpu_stack.driver_major(driver)}); fix: {gpu_stack.driver_fix(need)}"), ""


def preflight(c: Cluster, h: HostState) -> Outcome:
    o = c.opts
    res = h.remote.run(_facts_script(o.storage, needed_tools(c, gpus=1)), check=True)  # GPU or not: asked after
    facts, gpu_list, smi_failed = read_facts(res.stdout)
    # The script prints a count or "none"; the host's facts hold a number from the start, as the
    # later steps (install, the image, Ray's flags) read it.
    facts.pop("gpus", None)
    gpus = o.spec.n_gpus_per_node if o.dry_run else parse_gpu_count(res.stdout)
    h.facts.update(facts, gpus=gpus)
    if o.dry_run:
        return Outcome("ok", "dry run")
    sudo = facts.get("sudo", "")
    if sudo not in ("root", "yes"):
        why = "sudo is not installed" if sudo == "not-installed" else "sudo asks for a password"
        raise StepFailed(
            f"missing sudo: {h.remote.user} is not root and {why} on {h.name}; connect as root "
            f"(--username root) or add '{h.remote.user} ALL=(ALL) NOPASSWD: ALL' to /etc/sudoers.d/areal-kit", res)
    disk = facts.get("disk_gb", "missing")
    if disk == "missing":
        raise StepFailed(f"storage {o.storage} does not exist on {h.name}; mount the shared storage "
                         "at the same path on every host (or pass --storage)", res)
    if float(disk) < o.min_disk_gb:
        raise StepFailed(f"only {disk} GB free at {o.storage} on {h.name}, need {o.min_disk_gb:g} "
                         "(--min-disk-gb)", res)
    want = o.spec.n_gpus_per_node
    if want and gpus != want:
        said = f"; nvidia-smi fails: {smi_failed}" if smi_failed else ""
        raise StepFailed(f"{h.name} has {gpus} GPUs (nvidia-smi -L), the cluster spec says "
                         f"n_gpus_per_node={want}{said}", res)
    refusal, note = driver_check(c, h.name, gpu_list) if gpus else ("", "")
    if refusal:
        raise StepFailed(refusal, res)
    if smi_failed and not gpus:
        note += f" (nvidia-smi fails: {smi_failed}; taken as a host without GPUs)"
    missing = [t for t in needed_tools(c, gpus) if facts.get(f"has_{t}") != "yes"]
    if missing and facts.get("apt") == "no":
        raise StepFailed(by_hand(h.name, facts, missing), res)
    if facts.get("apt") == "no":
        note += f" (no apt-get: {', '.join(needed_tools(c, gpus)) or 'nothing'} already present)"
    return Outcome("ok", f"{facts.get('os')} {facts.get('arch')}, sudo {sudo}, {gpus} GPUs{note}, "
                         f"{disk} GB free at {o.storage}")


# -- 3. shared storage ------------------------------------------------------------------------
def storage(c: Cluster, h: HostState) -> Outcome:
    """The head writes a per-run marker; every other host must read the same bytes back,
    which proves the path is one shared filesystem and not a local directory."""
    o = c.opts
    d = f"{o.storage.rstrip('/')}/.areal-kit"
    marker = f"{d}/shared-check-{o.spec.cluster_name}"
    token = c.token
    changed = ""
    if o.nas_url:
        s = shlex.quote(o.storage)
        if not h.remote.run(f"mountpoint -q {s}", check=True).ok:
            must(c, h, f"(command -v mount.nfs >/dev/null || ({APT_ENV} apt-get install -y -q {TOOLS['mount.nfs'][0]})) && "
                       f"mkdir -p {s} && mount -t nfs {shlex.quote(o.nas_url)} {s}",
                 f"mounting {o.nas_url} at {o.storage}", sudo=True, timeout=300)
            changed = f"mounted {o.nas_url}; "
    status = "changed" if changed else "ok"
    if h.is_head:
        must(c, h, f"mkdir -p {shlex.quote(d)} && printf %s {shlex.quote(token)} > {shlex.quote(marker)}",
             f"writing to storage {o.storage}", sudo=True)
        return Outcome(status, f"{changed}{o.storage} writable")
    res = h.remote.run(q("cat", marker), check=True)
    if res.stdout.strip() != token:
        fail(c, f"storage {o.storage} on {h.name} is not the filesystem the head {c.head.name} sees "
                f"(marker {marker} written by the head is missing or different); mount the same "
                "shared storage at that path on every host", res)
    return Outcome(status, f"{changed}{o.storage} shared with {c.head.name}")


# -- 4. install -------------------------------------------------------------------------------
def install(c: Cluster, h: HostState) -> Outcome:
    o = c.opts
    done: list[str] = []
    notes: list[str] = []
    if o.runtime == "host":
        # No package installs for the host runtime: the Python env is the user's (HPC module,
        # conda, venv on shared storage); we only check it has what Ray nodes need.
        res = h.remote.run(q(o.python, "-c", "import ray, areal_kit; print(ray.__version__)"), check=True)
        if not res.ok:
            fail(c, f"--runtime host needs {o.python} with ray and areal_kit on every host; "
                    f"install areal-kit there or pass --python PATH", res)
        return Outcome("ok", f"ray {res.stdout.strip()} via {o.python}")
    gpus = h.facts.get("gpus", 0)
    lacking = [t for t in needed_tools(c, gpus) if t != "mount.nfs"
               and not h.remote.run(f"command -v {t} >/dev/null 2>&1", check=True).ok]
    missing = [TOOLS[t][0] for t in lacking if t != "nvidia-ctk"]
    need_nvidia = "nvidia-ctk" in lacking
    if not gpus:
        notes.append("no nvidia-smi: skipping nvidia-container-toolkit")
    if lacking and h.facts.get("apt") == "no" and not o.dry_run:  # preflight names them first; gone since?
        raise StepFailed(by_hand(h.name, h.facts, lacking))
    if missing:
        must(c, h, f"apt-get update -q && {APT_ENV} apt-get install -y -q {q(*missing)}",
             f"apt-get install {' '.join(missing)}", sudo=True, timeout=1200)
        done.append("installed " + " ".join(missing))
    if need_nvidia:
        must(c, h, NVIDIA_REPO, "adding NVIDIA's apt repository", sudo=True, timeout=300)
        must(c, h, f"apt-get update -q && {APT_ENV} apt-get install -y -q nvidia-container-toolkit && "
                   "nvidia-ctk runtime configure --runtime=docker && "
                   "(systemctl restart docker || service docker restart)",
             "installing nvidia-container-toolkit", sudo=True, timeout=1200)
        done.append("installed nvidia-container-toolkit")
    if not h.remote.run(docker(h, "info", "--format", "{{.ServerVersion}}"), sudo=True, check=True).ok:
        must(c, h, "systemctl start docker 2>/dev/null || service docker start", "starting dockerd",
             sudo=True, timeout=120)
        res = h.remote.run("for i in $(seq 1 30); do docker info >/dev/null 2>&1 && exit 0; sleep 1; done; "
                           "docker info", sudo=True)
        if not res.ok:
            fail(c, f"dockerd is not running on {h.name} and could not be started", res)
        done.append("started dockerd")
    if done:
        return Outcome("changed", "; ".join(done + notes))
    return Outcome("ok", "; ".join(["docker, git-lfs present"] + notes))


# -- 5. image ---------------------------------------------------------------------------------
def image(c: Cluster, h: HostState) -> Outcome:
    """The runtime image on every host: present, loaded from a tarball, pulled, or (areal-kit's own,
    no --image) built once on the head and loaded from the storage by the others: then run head first."""
    o = c.opts
    if o.runtime != "docker":
        return Outcome("skipped", "runtime host: no image")
    if o.image is None and h.is_head:
        return _own_image_on_head(c, h)
    present = _inspect(h, c.image)
    if present.ok:
        return Outcome("ok", f"{c.image} present ({present.stdout.strip()[:19]})")
    tar = o.image_tar or (own_image.tarball_path(o.storage, c.image) if o.image is None else None)
    if tar:
        return _load(c, h, tar)
    must(c, h, docker(h, "pull", c.image), f"docker pull {c.image}", sudo=True, timeout=3600)
    return Outcome("changed", f"pulled {c.image}")


def _inspect(h: HostState, tag: str) -> Result:
    return h.remote.run(docker(h, "image", "inspect", "--format", "{{.Id}}", tag), sudo=True, check=True)


def _load(c: Cluster, h: HostState, tar: str) -> Outcome:
    res = h.remote.run(q("test", "-f", tar), check=True)
    if not res.ok:
        fail(c, f"image tarball {tar} not found on {h.name} (is the shared storage mounted?)", res)
    load = must(c, h, docker(h, "load", "-i", tar), f"docker load -i {tar}", sudo=True, timeout=1800)
    if not h.remote.run(docker(h, "image", "inspect", "--format", "{{.Id}}", c.image), sudo=True).ok:
        fail(c, f"{tar} does not contain {c.image} ({load.stdout.strip() or 'nothing loaded'})", load)
    return Outcome("changed", f"loaded {c.image} from {tar}")


def _own_image_on_head(c: Cluster, h: HostState) -> Outcome:
    """areal-kit's own image, for CPU or GPU by the hosts' hardware, on the head; saved to the storage
    for the others (one host needs no tarball). Present already: kept, its tarball written if missing."""
    o = c.opts
    own = own_image.resolve(own_image.accelerator([x.facts for x in c.hosts]), o.build_args)
    c.image = own.tag
    tar = own_image.tarball_path(o.storage, own.tag)
    share = len(c.hosts) > 1
    present = _inspect(h, own.tag)
    if present.ok:
        if not share or h.remote.run(q("test", "-f", tar), check=True).ok:
            return Outcome("ok", f"{own.tag} present ({present.stdout.strip()[:19]})")
        must(c, h, own_image.save_cmd(own.tag, tar, c.token), f"docker save {own.tag}", sudo=True, timeout=1800)
        return Outcome("changed", f"{own.tag} present; saved to {tar}")
    if h.remote.run(q("test", "-f", tar), check=True).ok:
        return _load(c, h, tar)  # saved by an earlier setup whose head was another host, or pruned here
    ctx = f"/tmp/areal-kit-context-{c.token}.tar"
    h.remote.put_bytes(own.context, ctx)
    try:
        built = must(c, h, own_image.build_cmd(own, ctx), f"docker build of {own.tag}", sudo=True,
                     timeout=4 * 3600)
    finally:
        h.remote.run(q("rm", "-f", ctx), sudo=True)
    done = f"built {own.tag} ({own.accelerator}) in {built.seconds:.0f} s"
    if share:
        must(c, h, own_image.save_cmd(own.tag, tar, c.token), f"docker save {own.tag}", sudo=True, timeout=1800)
        done += f"; saved to {tar}"
    return Outcome("changed", done)
