"""Container images of the SWE-bench env: find, pull or build an instance image; build a local base image.

Instance images (:func:`ensure_image`), in this order:

1. the image is already in the engine's store (``docker images`` / ``podman images``; Podman's
   ``localhost/`` and ``docker.io/`` prefixes are ignored when names are compared);
2. pulled from its registry (swebench publishes ``swebench/sweb.eval.x86_64.<id>:latest`` on Docker Hub)
   when ``pull`` is on (for Podman the name is qualified with ``docker.io/``);
3. built from a recipe when ``recipe_dir`` is set: a swebench task repository (``tasks/<instance_id>/
   Dockerfile`` with its build context, the layout ``swebench.task.repo`` reads), built with swebench's own
   ``swebench.image_builder.docker_build.build_instance_image``.

When every way fails, :class:`.sandbox.ImageUnavailableError` says what each attempt answered.

:func:`build_base_image` builds a small Debian image without any registry: ``debootstrap`` a minimal
root file system (git, python3, pytest, patch), add the non-root ``agent`` user and import it through
the Engine API.  The tests build their synthetic SWE-bench-shaped task images ``FROM`` it.
:func:`copy_image` copies an image from one engine to another (Docker's store into Podman's).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .engine import docker_client, engine_of, normalize_image_name, qualify_for_pull
from .sandbox import AGENT_USER, ImageUnavailableError

log = logging.getLogger(__name__)

#: Tag of the base image the tests build (``crl-bench swe base-image``).
BASE_IMAGE = "crl-bench/swe-base:bookworm"
BASE_PACKAGES = ("git", "python3", "python3-pytest", "patch", "procps")


def image_present(client, image: str) -> bool:
    """Whether ``image`` is in the daemon's store."""
    import docker

    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False


def local_images(client) -> set[str]:
    """Every ``repo:tag`` in the engine's store, also as Docker writes it (Podman names local images
    ``localhost/...`` and pulled ones ``docker.io/...``: both forms are in the set)."""
    tags = {t for img in client.images.list() for t in img.tags}
    return tags | {normalize_image_name(t) for t in tags}


def _pull(client, image: str) -> None:
    repo, _, tag = image.rpartition(":")
    if not repo or "/" in tag:
        repo, tag = image, "latest"
    if engine_of(client) == "podman":      # no short-name search registries on Debian's Podman
        repo = qualify_for_pull(repo)
    client.images.pull(repo, tag=tag)


def copy_image(image: str, source, target) -> str:
    """Copy ``image`` from one engine's store to another's (``docker save | podman load`` through the
    Engine API); returns ``image``. For a host where Docker has built or pulled images that a Podman
    sandbox should use (Podman names the copy ``localhost/<image>``; lookups by the short name find it).

    Raises:
        docker.errors.ImageNotFound: ``source`` has no ``image``. docker.errors.APIError: the load failed.
    """
    with tempfile.TemporaryFile(prefix="crl-swe-image-") as tmp:    # streamed: images can be GBs
        for chunk in source.images.get(image).save(named=True):
            tmp.write(chunk)
        tmp.seek(0)
        target.images.load(tmp)
    return image


def _build_from_recipe(client, instance_id: str, image: str, recipe_dir: str) -> None:
    from swebench.image_builder.docker_build import build_instance_image
    from swebench.image_builder.image_spec import make_image_spec
    from swebench.task.repo import load_dockerfiles, task_paths

    dockerfiles = load_dockerfiles(recipe_dir, [instance_id])
    if instance_id not in dockerfiles:
        raise FileNotFoundError(f"no tasks/{instance_id}/Dockerfile in {recipe_dir}")
    repo, _, tag = image.rpartition(":")
    namespace = repo.split("/")[0] if "/" in repo else None
    spec = make_image_spec({"instance_id": instance_id}, dockerfiles[instance_id], namespace=namespace,
                           tag=tag or "latest", context_dir=task_paths(recipe_dir, [instance_id])[instance_id])
    build_instance_image(spec, client, None, nocache=False)
    if spec.name != image and image_present(client, spec.name):
        client.images.get(spec.name).tag(repo, tag or "latest")


def ensure_image(image: str, instance_id: str = "", client=None, pull: bool = True,
                 recipe_dir: str | None = None) -> str:
    """Make ``image`` available in the daemon (present, else pulled, else built); returns its name.

    Args:
        image: the instance's image name (the data set's ``image`` column).
        instance_id: used to find the recipe in ``recipe_dir``.
        client: an Engine API client, Docker's or Podman's (default :func:`.engine.docker_client`: the
            engine of ``$CRL_BENCH_SWE_ENGINE``, else Docker).
        pull: try the registry.
        recipe_dir: a swebench task repository to build from.

    Raises:
        DockerUnavailableError: no daemon.
        ImageUnavailableError: every way failed; the message gives each one's answer.
    """
    client = client or docker_client()
    if image_present(client, image):
        return image
    cli = engine_of(client)
    tried = [f"not present locally (`{cli} images` has no {image})"]
    if pull:
        try:
            _pull(client, image)
            return image
        except Exception as e:  # noqa: BLE001 - registry unreachable, unknown image, auth...
            tried.append(f"pulling it failed: {str(e).strip()[:300]}")
    else:
        tried.append("pulling is off (pull: false)")
    if recipe_dir:
        try:
            _build_from_recipe(client, instance_id, image, recipe_dir)
            if image_present(client, image):
                return image
            tried.append(f"building it from {recipe_dir} produced no {image}")
        except Exception as e:  # noqa: BLE001 - swebench's BuildImageError and I/O errors alike
            tried.append(f"building it from {recipe_dir} failed: {str(e).strip()[:300]}")
    else:
        tried.append("no recipe to build it from (set recipe_dir to a swebench task repository with "
                     "tasks/<instance_id>/Dockerfile)")
    raise ImageUnavailableError(
        f"no container image for {instance_id or image}: " + "; ".join(tried) + ". Pull the swebench "
        f"images where a registry is reachable (`{cli} pull {image}`), load them with `{cli} load`, or "
        f"give a recipe.")


def build_base_image(tag: str = BASE_IMAGE, suite: str = "bookworm",
                     mirror: str = "http://deb.debian.org/debian", packages: Sequence[str] = BASE_PACKAGES,
                     client=None, rebuild: bool = False) -> str:
    """Build (once) a minimal Debian image with ``packages`` and the ``agent`` user, without a registry.

    Runs ``debootstrap --variant=minbase`` into a temporary folder (needs root and Debian's
    ``debootstrap``; about a minute and 400 MB here), adds the user, tars the tree and imports it with
    the Engine API (``POST /images/create?fromSrc``) into ``client``'s engine (default
    :func:`.engine.docker_client`: ``CRL_BENCH_SWE_ENGINE=podman crl-bench swe base-image`` builds it
    for Podman; Podman lists it as ``localhost/<tag>``).  Returns ``tag``.

    Raises:
        DockerUnavailableError: no daemon.
        RuntimeError: not root, ``debootstrap`` missing, or a step failed (its output in the message).
    """
    client = client or docker_client(timeout=600)
    if not rebuild and image_present(client, tag):
        return tag
    if os.geteuid() != 0:
        raise RuntimeError("building the base image runs debootstrap, which needs root")
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap not found: install Debian's debootstrap package "
                           "(apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="crl-swe-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"

        def run(argv: list[str], what: str) -> None:
            p = subprocess.run(argv, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"{what} failed ({p.returncode}): {(p.stdout + p.stderr)[-1500:]}")

        run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite, str(root), mirror],
            "debootstrap")
        run(["chroot", str(root), "useradd", "-m", "-u", "1000", "-s", "/bin/bash", AGENT_USER], "useradd")
        run(["chroot", str(root), "apt-get", "clean"], "apt-get clean")
        tar = Path(tmp) / "rootfs.tar"
        run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(tar), "."], "tar")
        repo, _, tg = tag.rpartition(":")
        had_latest = image_present(client, f"{repo}:latest")
        out = client.api.import_image_from_file(str(tar), repository=repo, tag=tg,
                                                changes=['CMD ["/bin/bash"]', "ENV LANG=C.UTF-8"])
        if not image_present(client, tag):
            # Podman 4.3's Docker-compatible import ignores ``tag`` (names it ``<repo>:latest``): tag the
            # imported image (its id is in the answer) and drop the ``latest`` name it made
            ids = re.findall(r"sha256:[0-9a-f]{64}", str(out))
            if ids:
                client.images.get(ids[-1]).tag(repo, tg)
                if tg != "latest" and not had_latest and image_present(client, f"{repo}:latest"):
                    client.images.remove(f"{repo}:latest")
    if not image_present(client, tag):
        raise RuntimeError(f"importing the root file system did not produce {tag}")
    return tag
