"""`make lab`: the JupyterLab configuration of this project (`jupyter lab --config=tools/jupyter_lab_config.py`).

- The kernel is the project's: `python3` from the environment JupyterLab runs in (`.venv`), whose `medsafe_nb` is this
  checkout (`pip install -e .`).
- Saving a notebook leaves it as `make check` wants it: cleaned with nbdev's rules from settings.ini (no execution
  counts, no metadata but the allowed keys, cell ids kept), and an analysis notebook (nbs/analysis/) saved without its
  outputs, as the repository holds it: its tables and figures are in figures/, its executed copy in figures/executed/.
  A notebook outside an nbdev project is saved as it is.
- Nothing is fetched from the network: no news, no update check.
Plain tooling, read by the Jupyter server: it needs nbdev (in requirements.txt) and nothing from medsafe_nb.
"""
from pathlib import Path


def project_settings(path:Path)->tuple[Path, dict]|tuple[None, None]:
    "The nbdev project holding `path`: its folder and settings.ini's [DEFAULT] section (None, None outside one)"
    import configparser
    for d in [path.parent, *path.parent.parents]:
        if (d / "settings.ini").is_file():
            cp = configparser.ConfigParser(interpolation=None)
            cp.read(d / "settings.ini", encoding="utf-8")
            return d, dict(cp["DEFAULT"])
    return None, None


def clean_notebook(nb:dict, path:Path)->bool:
    "Clean a notebook's JSON in place as `nbdev_clean` does, outputs cleared under nbs/analysis/; False outside an nbdev project"
    from nbdev.clean import clean_nb
    root, cfg = project_settings(path.resolve())
    if root is None: return False
    flag = lambda k, default: cfg.get(k, default).strip().lower() in ("true", "1", "yes")
    clean_nb(nb, clear_all=flag("clear_all", "false"), allowed_metadata_keys=cfg.get("allowed_metadata_keys", "").split(),
             allowed_cell_metadata_keys=cfg.get("allowed_cell_metadata_keys", "").split(), clean_ids=flag("clean_ids", "true"))
    if path.resolve().is_relative_to(root / cfg.get("nbs_path", "nbs") / "analysis"):
        for cell in nb.get("cells", []):
            if cell.get("cell_type") == "code": cell["outputs"], cell["execution_count"] = [], None
    return True


def clean_on_save(model:dict, path:str, contents_manager=None, **kwargs):
    "The Jupyter server's pre-save hook: clean every notebook it saves (`clean_notebook`)"
    if model.get("type") != "notebook" or (model.get("content") or {}).get("nbformat") != 4: return
    root = Path(contents_manager.root_dir) if contents_manager is not None else Path.cwd()
    clean_notebook(model["content"], root / path)


import warnings
warnings.filterwarnings("ignore", message="Overriding existing pre_save_hook")   # the server and JupyterLab both read this file

c = get_config()  # noqa: F821 (Jupyter's config loader defines it)
c.FileContentsManager.pre_save_hook = clean_on_save
c.MappingKernelManager.default_kernel_name = "python3"
c.LabApp.news_url = None
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
