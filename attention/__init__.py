"""gqa-lab attention: MHA, GQA and MQA through one `num_kv_heads`."""

from attention.core import attention_mask, dot_product_attention
from attention.module import Attention
from attention.rope import apply_rope

__all__ = ['Attention', 'apply_rope', 'attention_mask', 'dot_product_attention']
