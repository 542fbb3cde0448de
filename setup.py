"""Packaging for slm_bench. Every requirement and setting is read from settings.ini (nbdev 2's config)."""
import shlex
from configparser import ConfigParser

import setuptools

config = ConfigParser(delimiters=["="])
config.read("settings.ini", encoding="utf-8")
cfg = config["DEFAULT"]

required_keys = "lib_name version description author author_email min_python license requirements".split()
missing = [k for k in required_keys if k not in cfg]
if missing:
    raise SystemExit(f"settings.ini is missing {', '.join(missing)}")


def split_requirements(key):
    return shlex.split(cfg.get(key, ""))


# `extras_<name> = ...` keys become the `[name]` extras; `dev_requirements` is the `[dev]` extra.
extras = {key[len("extras_"):]: split_requirements(key) for key in cfg if key.startswith("extras_")}
extras["dev"] = split_requirements("dev_requirements")

setuptools.setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    description=cfg["description"],
    author=cfg["author"],
    author_email=cfg["author_email"],
    license="Apache-2.0",
    url=cfg.get("git_url", ""),
    keywords=cfg.get("keywords", ""),
    packages=setuptools.find_packages(include=[cfg["lib_name"], cfg["lib_name"] + ".*"]),
    include_package_data=True,
    # versioned teacher prompt templates and judge rubrics; the real benchmark files (gzip) with their licenses
    package_data={cfg["lib_name"]: ["data/prompts/*/*.txt", "infer/csrc/*.cpp", "evals/rubrics/*.txt", "evals/datasets/README.md", "evals/datasets/*/*"]},
    install_requires=split_requirements("requirements"),
    extras_require=extras,
    python_requires=">=" + cfg["min_python"],
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    zip_safe=False,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "License :: OSI Approved :: Apache Software License",
    ],
    entry_points={
        "console_scripts": cfg.get("console_scripts", "").split(),
        "nbdev": [f'{cfg.get("lib_path")}={cfg.get("lib_path")}._modidx:d'],
    },
)
