"""What a stage is, below the code that runs one: its name and folder (`names`), its identity (`identity`), its
folder's record — done, set aside, resumed (`folder`) — and the recipe's plan of them (`plan`)."""

from .folder import (MODEL_IDENTITY, aside_dir, checkpoint_dirs, checkpoint_step, claim_stage, finished,
                     last_checkpoint_step, model_identity, output_identity, read_stage, resume_step, stage_done,
                     trainer_checkpoints, write_json, write_stage)
from .identity import (TEACHER_RESULT_FIELDS, TRAJECTORY_FREE, async_fingerprint_part, base_identity,
                       behaviour_fingerprint_part, data_fingerprint_part, expert_fingerprint, expert_loop_config,
                       model_ref_id, mopd_fingerprint, precision_fingerprint_part, round_fingerprint_part,
                       sft_fingerprint, train_fingerprint_part)
from .names import (expert_init_stage, last_student_label, parse_stage, round_dir, round_prefix, round_stage,
                    stage_dir, stage_label, student_init_stage)
from .plan import StageSpec, plan_rounds, stage_plan, stage_spec, teacher_roles

__all__ = [
    "MODEL_IDENTITY", "aside_dir", "checkpoint_dirs", "checkpoint_step", "claim_stage", "finished",
    "last_checkpoint_step", "model_identity", "output_identity", "read_stage", "resume_step", "stage_done",
    "trainer_checkpoints", "write_json", "write_stage",
    "TEACHER_RESULT_FIELDS", "TRAJECTORY_FREE", "async_fingerprint_part", "base_identity",
    "behaviour_fingerprint_part", "data_fingerprint_part", "expert_fingerprint", "expert_loop_config",
    "model_ref_id", "mopd_fingerprint", "precision_fingerprint_part", "round_fingerprint_part", "sft_fingerprint",
    "train_fingerprint_part",
    "expert_init_stage", "last_student_label", "parse_stage", "round_dir", "round_prefix", "round_stage",
    "stage_dir", "stage_label", "student_init_stage",
    "StageSpec", "plan_rounds", "stage_plan", "stage_spec", "teacher_roles",
]
