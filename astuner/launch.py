"""The work of `astuner --conf x.yaml` without its argument parsing: check the config, plan the start (fresh or
resumed), save the config, run the backbone. `astuner serve` (remote agents) and `tune()` call it too."""

import dataclasses
import os
import sys

from astuner.errors import UserError


def run(conf: str, backbone: str, overrides: list[str], with_ray: bool = False, with_logview: bool = False,
        workflow: type | None = None) -> None:
    """The command's work, without argument parsing. Raises UserError for bad input. `workflow`: a class run in
    place of the one the config names (`LoadedConfig.workflow`), in this process (the debug backbone)."""
    from astuner.config.backbones import backbone as backbone_record, names_where  # light: no torch, no Hydra

    record = backbone_record(backbone)  # a UserError naming the backbones for an unknown one
    if with_ray and not record.on_ray:
        on_ray = names_where("on_ray")
        raise UserError(f"--with-ray places the {' or '.join(on_ray)} backbone on a Ray cluster; the {backbone} "
                        f"backbone runs in this one process. Drop --with-ray, or add --backbone {on_ray[0]}.")

    from astuner import run_lock
    from astuner.config import config_warnings, load_config, save_config
    from astuner.engine.fingerprint import fingerprint_threads
    from astuner.resume import plan_start

    fingerprint_threads()  # a bad ASTUNER_FINGERPRINT_THREADS refused now, not at the first sync
    loaded = load_config(conf, overrides, backbone=backbone)
    for note in loaded.derived:
        print(f"astuner: derived {note}", file=sys.stderr)
    for warning in config_warnings(loaded, backbone):
        # Printed rather than logged: logging is configured by the backbone, which has not started yet.
        print(f"astuner: warning: {warning}", file=sys.stderr)
    start = plan_start(loaded)
    loaded = start.loaded if workflow is None else dataclasses.replace(start.loaded, workflow=workflow)
    folder = run_lock.claim(loaded.experiment_dir)  # held to the run's end: one live run per folder
    try:
        print(f"astuner: {start.message}", file=sys.stderr)
        if start.note:
            print(f"astuner: {start.note}", file=sys.stderr)
        save_config(loaded, resumed_at=start.resumed_step)
        print(f"astuner: config saved in {loaded.experiment_dir}", file=sys.stderr)
        _run(backbone, loaded, start, with_ray, with_logview)
    except UserError:
        _forget(folder)
        raise
    finally:
        folder.release()


def _forget(folder) -> None:
    """A start refused for bad input (a misspelt class, a missing file) leaves no folder behind: one it created and
    that holds no results yet goes, so the corrected command starts there rather than in `<folder>_1`."""
    import shutil

    from astuner.resume import has_results

    # The log sink's open file outlives the folder harmlessly; prints routed to it then reach the console.
    if folder.created is None or not folder.folder.is_dir() or has_results(folder.folder):
        return
    shutil.rmtree(folder.folder, ignore_errors=True)
    for above in folder.folder.parents:  # the folders above it this run created, while empty (another run's stay)
        if not above.is_relative_to(folder.created):
            break
        try:
            above.rmdir()
        except OSError:
            break


def _run(backbone: str, loaded, start, with_ray: bool, with_logview: bool) -> None:
    # Runs must not reach for the Hugging Face hub (offline clusters, reproducibility); a user can still opt in.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from astuner.backbone import run_backbone

    viewer = None
    if with_logview:
        from astuner.logview.app import LogViewServer

        viewer = LogViewServer(loaded.experiment_dir, loaded.typed.astuner.logview.port)
        print(f"astuner: log viewer at {viewer.start()} (this run's trajectories appear as its steps finish)",
              file=sys.stderr)
    try:
        run_backbone(backbone, loaded, checkpoint=start.checkpoint, with_ray=with_ray)
    finally:
        if viewer is not None:
            viewer.stop()
            print(f"astuner: log viewer stopped; reopen this run with: astuner logview {loaded.experiment_dir}",
                  file=sys.stderr)
