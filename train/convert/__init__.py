"""Checkpoint conversions, `python -m train.convert`: to fewer K/V heads
(Ainslie et al. 2023), into latent attention (`to_mla`), grouped-tied
attention (`to_gta`) or tensor product attention (`to_tpa`), and in from and out to Hugging Face (`hf`,
`hf_deepseek`, `safetensors_io`). `workdirs` runs each end to end, a workdir
or a Hugging Face folder in, a new one out."""

from train.convert.workdirs import (HF_UPTRAINING_LEARNING_RATE,
                                    convert_params, convert_to_gta,
                                    convert_to_mla, convert_to_tpa,
                                    convert_workdir,
                                    export_hf, import_hf, is_kv_kernel,
                                    pool_heads)

__all__ = ['HF_UPTRAINING_LEARNING_RATE', 'convert_params', 'convert_to_gta',
           'convert_to_mla', 'convert_to_tpa', 'convert_workdir', 'export_hf', 'import_hf',
           'is_kv_kernel', 'pool_heads']
