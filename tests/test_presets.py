"""presets/: one paper table a file, for `flwr run . --run-config presets/<name>.toml`.

Each preset parses as `flwr run` parses it (flwr's own parser, and the SuperLink's check that every key is
one of the app's) and holds only known keys with valid values; every value line names its source; each
passes preflight offline against stand-ins (a Hugging Face cache holding the real component configs of the
pipelines the presets name, no weights; small local datasets in the hub datasets' column layouts); and
each runs one round end to end with its sizes brought down (a random-weight SD-layout prior at 32 px, two or
three clients, a few steps) on the same stand-in data.
"""

import hashlib
import json
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
from flwr.common.config import flatten_dict, fuse_dicts, parse_config_args
from flwr.supercore.utils import simulation_config_from_json

from fedapp.config import all_defaults, parse_run_config
from fedapp.options import option_values
from fedapp.preflight import preflight
from feddata import LazyImages

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {p.stem: p for p in sorted((ROOT / "presets").glob("*.toml"))}
NAMES = ["espresso-domainnet", "espresso-pacs", "espresso-nicopp", "feddifrc-cifar10-a0.05", "feddifrc-cifar10-a0.5",
         "feddifrc-cifar10-nid2", "pfdm-cmnist", "pfdm-mnist-dpdm", "dcfm-cmnist-noniid", "dcfm-cmnist-iid"]

# ---- the source comment of a value line --------------------------------------------------------------------

KEY_LINE = re.compile(r"^(?P<key>[A-Za-z0-9_.-]+) = (?P<value>.+?)\s+# (?P<source>.+)$")
# "paper: <part>" names the part of the paper that gives the value; "official code: <file>" the authors' file;
# "not stated" says neither gives it
SOURCE = re.compile(r"^(?:paper: (?:method|main table|training details|limitations|attack table|communication "
                    r"table|DPDM comparison|Fig\. \d+|Theorem \d+(?:\.\d+)?|Algorithm \d+|eq\. \d+)\b"
                    r"|official code: [\w/.-]+\.py\b|not stated\b)")
FEDERATION = re.compile(r"^# federation: num-supernodes=(\d+) \((.+)\)$", re.M)


def value_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def unsourced(text: str) -> list[str]:
    """The value lines of a preset without a source comment."""
    out = []
    for line in value_lines(text):
        m = KEY_LINE.match(line)
        if m is None or not SOURCE.match(m["source"]):
            out.append(line)
    return out


def preset(name: str) -> dict:
    return parse_config_args([str(PRESETS[name])])  # what `flwr run . --run-config <file>` sends


def clients(name: str) -> int:
    return int(FEDERATION.search(PRESETS[name].read_text()).group(1))


# ---- stand-ins: Stable Diffusion's real component configs, no weights --------------------------------------

SD15_UNET = {
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.6.0", "act_fn": "silu", "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False, "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]}
SD15_VAE = {
    "_class_name": "AutoencoderKL", "_diffusers_version": "0.6.0", "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4, "in_channels": 3,
    "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 3, "sample_size": 512,
    "up_block_types": ["UpDecoderBlock2D"] * 4}
SD15_TEXT = {
    "architectures": ["CLIPTextModel"], "attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0, "eos_token_id": 2,
    "hidden_act": "quick_gelu", "hidden_size": 768, "initializer_factor": 1.0, "initializer_range": 0.02,
    "intermediate_size": 3072, "layer_norm_eps": 1e-05, "max_position_embeddings": 77, "model_type": "clip_text_model",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1, "projection_dim": 768,
    "torch_dtype": "float32", "vocab_size": 49408}
SD15_SCHEDULER = {
    "_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "beta_start": 0.00085, "num_train_timesteps": 1000, "set_alpha_to_one": False, "skip_prk_steps": True,
    "steps_offset": 1, "trained_betas": None, "clip_sample": False}
SD21_UNET = {**SD15_UNET, "_diffusers_version": "0.10.0.dev0", "attention_head_dim": [5, 10, 20, 20],
             "cross_attention_dim": 1024, "sample_size": 96, "use_linear_projection": True, "upcast_attention": True,
             "dual_cross_attention": False, "num_class_embeds": None, "only_cross_attention": False}
SD21_VAE = {**SD15_VAE, "sample_size": 768}
SD21_TEXT = {**SD15_TEXT, "hidden_act": "gelu", "hidden_size": 1024, "intermediate_size": 4096,
             "num_attention_heads": 16, "num_hidden_layers": 23, "projection_dim": 512}
SD21_SCHEDULER = {**SD15_SCHEDULER, "_class_name": "DDIMScheduler", "prediction_type": "v_prediction"}


def sd_files(unet: dict, vae: dict, text: dict, scheduler: dict) -> dict[str, dict]:
    index = {"_class_name": "StableDiffusionPipeline", "scheduler": ["diffusers", scheduler["_class_name"]],
             "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
             "feature_extractor": ["transformers", "CLIPImageProcessor"], "safety_checker": [None, None]}
    return {"model_index.json": index, "unet/config.json": unet, "vae/config.json": vae,
            "text_encoder/config.json": text, "scheduler/scheduler_config.json": scheduler,
            "tokenizer/tokenizer_config.json": {"model_max_length": 77}}


# the ImageNet ResNet-18 Espresso's presets name: transformers' ResNet config at ResNet-18's depths and widths
RESNET18 = {"model_type": "resnet", "architectures": ["ResNetForImageClassification"], "num_channels": 3,
            "embedding_size": 64, "hidden_sizes": [64, 128, 256, 512], "depths": [2, 2, 2, 2], "layer_type": "basic",
            "hidden_act": "relu", "downsample_in_first_stage": False}

HUB = {"runwayml/stable-diffusion-v1-5": sd_files(SD15_UNET, SD15_VAE, SD15_TEXT, SD15_SCHEDULER),
       "stabilityai/stable-diffusion-2-1": sd_files(SD21_UNET, SD21_VAE, SD21_TEXT, SD21_SCHEDULER),
       "microsoft/resnet-18": {"config.json": RESNET18}}


def write_hub_cache(root: Path) -> Path:
    """A Hugging Face hub cache (models--<org>--<name>/refs/main, snapshots/<commit>/...) holding HUB's files."""
    for repo, files in HUB.items():
        entry = root / f"models--{repo.replace('/', '--')}"
        commit = hashlib.sha1(repo.encode()).hexdigest()
        (entry / "refs").mkdir(parents=True, exist_ok=True)
        (entry / "refs" / "main").write_text(commit)
        for rel, content in files.items():
            path = entry / "snapshots" / commit / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(content))
    return root


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    return write_hub_cache(tmp_path_factory.mktemp("hub"))


@pytest.fixture
def hub(hub_dir, monkeypatch):
    """The stand-in cache as the Hugging Face cache, offline (as the suite runs)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_dir))
    return hub_dir


# ---- stand-ins: small datasets in the layouts the presets name ----------------------------------------------

DOMAINNET = ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
NICOPP = ["autumn", "dim", "grass", "outdoor", "rock", "water"]
PACS = ["art_painting", "cartoon", "photo", "sketch"]
CIFAR10 = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _images(n: int, size: int, mode: str, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (size, size, 3) if mode == "RGB" else (size, size)
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode) for _ in range(n)]


def image_folder(root: Path, domains: list[str], classes: int, per: int) -> Path:
    """The layout docs/papers.md asks DomainNet and NICO++ in: images with a metadata.csv of file_name, label
    and domain."""
    rows, k = ["file_name,label,domain"], 0
    for d in domains:
        for c in range(classes):
            for img in _images(per, 16, "RGB", k):
                name = f"{d}/{c}_{k}.png"
                (root / d).mkdir(parents=True, exist_ok=True)
                img.save(root / name)
                rows.append(f"{name},class{c},{d}")
                k += 1
    (root / "metadata.csv").write_text("\n".join(rows) + "\n")
    return root


def saved_dataset(root: Path, image_col: str, names: list[str], per: int, size: int, mode: str,
                  domains: list[str] | None = None) -> Path:
    """A `save_to_disk` folder with the hub dataset's columns (image or img, a ClassLabel label, a domain)."""
    import datasets

    n = len(names) * per * len(domains or [None])
    cols = {image_col: _images(n, size, mode, 0), "label": [i % len(names) for i in range(n)]}
    feats = {image_col: datasets.Image(), "label": datasets.ClassLabel(names=names)}
    if domains:
        cols["domain"] = [domains[(i // len(names)) % len(domains)] for i in range(n)]
        feats["domain"] = datasets.Value("string")
    datasets.Dataset.from_dict(cols, features=datasets.Features(feats)).save_to_disk(str(root))
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Each preset's dataset, or its stand-in: the built-in sets are themselves."""
    tmp = tmp_path_factory.mktemp("data")
    domainnet = str(image_folder(tmp / "domainnet", DOMAINNET, 10, 2))
    nicopp = str(image_folder(tmp / "nicopp", NICOPP, 10, 2))
    pacs = str(saved_dataset(tmp / "pacs", "image", ["dog", "elephant", "giraffe", "guitar", "horse", "house",
                                                      "person"], 2, 24, "RGB", PACS))
    cifar10 = str(saved_dataset(tmp / "cifar10", "img", CIFAR10, 100, 32, "RGB"))  # Dirichlet(0.05): >= 10 a client
    mnist = str(saved_dataset(tmp / "mnist", "image", [str(d) for d in range(10)], 30, 28, "L"))
    return {"espresso-domainnet": domainnet, "espresso-pacs": pacs, "espresso-nicopp": nicopp,
            **{n: cifar10 for n in NAMES if n.startswith("feddifrc-")}, "pfdm-mnist-dpdm": mnist}


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    """A random-weight SD-1.5-layout pipeline at 32 px (fedapp.models.prior.sd_layout), saved as a folder."""
    from fedapp.models.prior.sd_layout import random_sd_pipeline

    tmp = tmp_path_factory.mktemp("tiny-sd")
    random_sd_pipeline(tmp, image_size=32, levels=2).save_pretrained(tmp / "pipeline")
    return str(tmp / "pipeline")


def on_stand_in(name: str, data: dict, out: Path, **extra) -> dict:
    return {**all_defaults(), **preset(name), **({"dataset": data[name]} if name in data else {}),
            "out-dir": str(out), **extra}


# ---- 1. the file parses as flwr parses it, into known keys with valid values -------------------------------

def test_there_is_one_preset_per_table():
    assert sorted(PRESETS) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_preset_parses_as_flwr_run_parses_it_into_valid_keys(name):
    flat = preset(name)
    raw = tomllib.loads(PRESETS[name].read_text())
    assert flat == flatten_dict(raw) and flat, name  # dotted keys at the top level: one flat table
    app = flatten_dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    fuse_dicts(app, flat, check_keys=True)  # the SuperLink's check: every key is one of the app's
    assert set(flat) <= set(all_defaults())
    cfg = parse_run_config({**all_defaults(), **flat})
    assert cfg.method == flat["method"]
    own = {cfg.spec.namespace, "partitioner", "log"}
    assert {k.split(".")[0] for k in flat if "." in k} <= own, "a key of another method's namespace"
    kept = {**option_values(cfg.common), **{f"partitioner.{k}": v for k, v in cfg.partitioner_params.items()},
            **{f"{ns}.{k}": v for ns, values in cfg.namespace_values.items() for k, v in values.items()}}
    # every value reaches the run as written (and no key belongs to a partitioner the preset does not use)
    assert {k: kept[k] for k in flat} == flat


@pytest.mark.parametrize("name", NAMES)
def test_the_header_gives_the_command_and_the_federation(name):
    text = PRESETS[name].read_text()
    m = FEDERATION.search(text)
    assert m and SOURCE.match(m.group(2)), "a '# federation: num-supernodes=N (<source>)' line"
    command = f'flwr run . --run-config presets/{name}.toml --federation-config "num-supernodes={m.group(1)}"'
    assert command in text
    federation = parse_config_args([f"num-supernodes={m.group(1)}"])
    assert simulation_config_from_json({"num_supernodes": federation["num-supernodes"]}).num_supernodes == clients(name)
    assert preset(name)["min-clients"] <= clients(name)


# ---- 2. every value names its source ------------------------------------------------------------------------

def test_the_source_pattern_refuses_a_line_without_a_source():
    ok = 'espresso.clusters = 4   # paper: training details (J = 4)\nlr = 0.01  # official code: main.py (SGD)\n' \
         'espresso.steps = 50   # not stated\nx = "#"  # paper: Fig. 6\nt = 1  # paper: Theorem 5.1 (example)'
    assert unsourced(ok) == []
    bad = ["espresso.clusters = 4", "espresso.clusters = 4  # J", "lr = 0.01  # the paper", "a = 1  #paper: method",
           "b = 2  # paper: somewhere", "c = 3  # official code", "d = 4  # stated nowhere"]
    assert unsourced("\n".join(bad)) == bad


@pytest.mark.parametrize("name", NAMES)
def test_every_value_line_names_its_source(name):
    text = PRESETS[name].read_text()
    assert unsourced(text) == []
    assert len(value_lines(text)) == len(preset(name))  # one key a line


# ---- 3. preflight, offline, against stand-ins ---------------------------------------------------------------

def test_the_stand_ins_are_stable_diffusions_real_components():
    """Built from the stand-in configs on the meta device (no memory), the components have the published
    parameter counts of SD v1.5 and SD 2.1."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    with torch.device("meta"):
        for unet, vae, text, sizes in ((SD15_UNET, SD15_VAE, SD15_TEXT, (859_520_964, 83_653_863, 123_060_480)),
                                       (SD21_UNET, SD21_VAE, SD21_TEXT, (865_910_724, 83_653_863, 340_387_840))):
            u, v = UNet2DConditionModel.from_config(unet), AutoencoderKL.from_config(vae)
            t = CLIPTextModel(CLIPTextConfig(**{k: x for k, x in text.items() if k != "architectures"}))
            assert (count(u), count(v), count(t)) == sizes
            assert next(u.parameters()).is_meta


@pytest.mark.parametrize("name", NAMES)
def test_a_preset_passes_preflight_offline(name, hub, data, tmp_path):
    """The prior (a hub id, read from the stand-in cache), its geometry against image-size, the method's own
    check, the classifier and the client sampling; no weights are loaded."""
    cfg = parse_run_config(on_stand_in(name, data, tmp_path))
    preflight(cfg)
    if cfg.spec.uses_prior:
        from fedapp.models.prior import prior_image_size

        assert prior_image_size(cfg.prior, cfg.dataset) == {"runwayml/stable-diffusion-v1-5": 512,
                                                            "stabilityai/stable-diffusion-2-1": 768}[cfg.prior]


@pytest.mark.parametrize("name", NAMES)
def test_a_preset_passes_preflight_on_the_papers_federation(name, hub, data, tmp_path):
    """With the data on the paper's number of nodes, at the paper's resolution (SD v1.5's 512 px, SD 2.1's
    768 px: feddata decodes a hub dataset or folder a batch at a time, so the size costs no memory here)."""
    cfg = parse_run_config(on_stand_in(name, data, tmp_path))
    preflight(cfg, clients(name))
    if name in data:  # a hub dataset or folder: served at the prior's size, undecoded until a batch is read
        from fedapp.data import client_shard, for_classifier

        x = client_shard(cfg, 0, clients(name)).train.x
        assert isinstance(x, LazyImages) and x.shape[1:] == (3, cfg.image_size, cfg.image_size)
        cls = for_classifier(x, cfg)  # the same rows at the classifier's own size (the preset's classifier-size)
        assert isinstance(cls, LazyImages) and cls[:1].shape == (1, 3, cfg.classifier_size, cfg.classifier_size)
        assert cfg.classifier_size == {"espresso": 224, "feddifrc": 32}.get(cfg.method, cfg.image_size)


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("espresso-")])
def test_the_domain_presets_give_client_k_domain_k(name, hub, data, tmp_path):
    """The stand-ins' domain column (a folder's metadata.csv, PACS's hub column) reaches the domain partitioner:
    on the paper's federation, client k holds domain k (in sorted order) and nothing else."""
    from fedapp.data import client_shard

    cfg = parse_run_config(on_stand_in(name, data, tmp_path))
    names = {"espresso-domainnet": DOMAINNET, "espresso-nicopp": NICOPP, "espresso-pacs": PACS}[name]
    for k in range(clients(name)):
        shard = client_shard(cfg, k, clients(name))
        assert shard.info.attributes["domain"] == sorted(names) and shard.meta["domain"] == sorted(names)[k]
        assert len(shard.train) > 0
        assert set(shard.train.attrs["domain"].tolist()) | set(shard.test.attrs["domain"].tolist()) == {k}


# ---- 4. one round end to end, sizes brought down ------------------------------------------------------------

SMALL = {
    "espresso": {"model": "resnet18",  # the same architecture, untrained: no ImageNet weights offline
                 "classifier-size": 16,  # below the prior's 32 px: synthetic images are resized for it
                 "espresso.features": "unet",  # no DINOv2 weights offline
                 "partitioner.per-class": 2, "min-clients": 2, "server-epochs": 1, "espresso.embed-steps": 2,
                 "espresso.mixup-pairs": 8, "espresso.diffusions-per-latent": 2, "espresso.steps": 2,
                 "espresso.ratio": 1.0, "espresso.synth-batch": 16, "espresso.clusters": 2,
                 "espresso.gmm-components": 2, "espresso.zigzag-t": 300},
    "feddifrc": {"num-server-rounds": 1, "local-epochs": 1, "batch-size": 16, "min-clients": 1,
                 "classifier-size": 16,  # below the prior's 32 px, as the paper's 32 px is below SD's
                 "partitioner.per-class": 3, "partitioner.min-partition-size": 1,
                 "feddifrc.up-blocks": "",  # the stand-in prior has 2 up-blocks, SD 4
                 "feddifrc.pca-fit": "client"},
    "pfdm": {"image-size": 8, "min-clients": 2, "partitioner.per-class": 20, "num-server-rounds": 1,
             "pfdm.local-steps": 3, "pfdm.shared-steps": 3, "pfdm.samples": 20, "pfdm.sample-steps": 4,
             "pfdm.attack-samples": 10, "pfdm.ref-epochs": 1, "pfdm.batch": 16, "pfdm.channels": "8,16",
             "pfdm.handover": "bounded"},  # z_w by DDIM's few steps, not ancestrally through all 1,000 levels
    "dcfm": {"image-size": 8, "min-clients": 3, "num-server-rounds": 1, "batch-size": 8, "dcfm.width": 8,
             "dcfm.local-steps": 2, "dcfm.peer-steps": 2, "dcfm.distill-steps": 2, "dcfm.replay-paths": 4,
             "dcfm.path-steps": 2, "dcfm.sample-steps": 2, "dcfm.samples-per-pair": 2, "dcfm.ref-epochs": 1,
             "dcfm.fl-local-steps": 2},
}
NODES = {"espresso": 2, "feddifrc": 2, "pfdm": 2, "dcfm": 3}


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("name", NAMES)
def test_a_preset_runs_one_round_with_its_sizes_brought_down(name, data, tiny_sd, tmp_path):
    from fedapp.simulation import simulate_in_process

    method = preset(name)["method"]
    prior = {"prior": tiny_sd, "image-size": "auto"} if method in ("espresso", "feddifrc") else {}
    small = {**SMALL[method], **prior}
    run = {**on_stand_in(name, data, tmp_path), **small}
    s = simulate_in_process(run, NODES[method])
    assert s["status"] == "completed" and s["failures"] == [], s.get("failures")
    config = json.loads((Path(s["run_dir"]) / "config.json").read_text())
    kept = {k: v for k, v in preset(name).items() if k not in small and k != "dataset"}
    assert {k: config[k] for k in kept} == kept  # the rest of the preset is what ran
    if method == "espresso":  # on the stand-in's domains, one a client, in sorted order (each grid names its own)
        names = sorted({"espresso-domainnet": DOMAINNET, "espresso-nicopp": NICOPP, "espresso-pacs": PACS}[name])
        grids = sorted(p.name for p in (Path(s["run_dir"]) / "images").glob("synthetic_client*.png"))
        assert grids == [f"synthetic_client0_{names[0]}.png", f"synthetic_client1_{names[1]}.png"]
