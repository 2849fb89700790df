"""Domains: where prompts come from and how answers are scored.

A `Domain` yields training prompts (`train_examples(n, rng)`), a fixed held-out eval set (`eval_examples()`,
never trained on) and a reward in [0, 1]. `build_domain(name, source, ...)` makes one from
`"synthetic:<kind>"` (character-level tasks: math, code, if, mathchain, ifshort, caps) or from a dataset file; rows
carry a `teacher_id` that routes each sample to its teacher. Verifiers score dataset rows; `code_tests` runs model
code only inside `sandbox.run_sandboxed` (resource limits, dropped privileges, namespaces, an audit hook).
"""

from .base import Domain, DomainError, Example, FrozenFields, exact_match, register_domain
from .build import available_domains, build_domain
from .dataset import DatasetDomain, check_teacher_ids, load_examples, load_examples_cached
from .sandbox import SandboxError, SandboxResult, run_python_tests, run_sandboxed, sandbox_layers
from .synthetic import (CodeDomain, InstructionDomain, MathChainDomain, MathDomain, ShortInstructionDomain,
                        SyntheticDomain)
from .verifiers import Verifier, available_verifiers, extract_code, get_verifier, register_verifier

__all__ = [
    "CodeDomain", "DatasetDomain", "Domain", "DomainError", "Example", "FrozenFields", "InstructionDomain",
    "MathChainDomain", "MathDomain", "SandboxError", "SandboxResult", "ShortInstructionDomain", "SyntheticDomain",
    "Verifier", "available_domains", "available_verifiers", "build_domain", "check_teacher_ids", "exact_match",
    "extract_code", "get_verifier", "load_examples", "load_examples_cached", "register_domain", "register_verifier",
    "run_python_tests", "run_sandboxed", "sandbox_layers",
]
