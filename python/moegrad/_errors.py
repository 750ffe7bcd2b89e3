"""The exception type of moegrad."""

# Status codes (docs/decisions.md D18).
SUCCESS = 0
ERR_PARAM_NULLPTR = 161001
ERR_PARAM_INVALID = 161002
ERR_INNER_TILING = 561002
ERR_FINALIZE_ROUTING = 561103
# No kernel for the call (ACLNN_ERR_INNER_FIND_KERNEL_ERROR): a gradient reached an operator
# without a gradient formula, e.g. a second-order gradient through a backward op (L150).
ERR_NO_KERNEL = 561003


class MoeError(RuntimeError):
    """Invalid input to a moegrad operator.

    ``code`` is the aclnn status (161001 null required tensor, 161002 dtype/format/value,
    561002 gating-forward or SwiGLU shape/attribute, 561103 finalize-routing shape/value, 561003
    a gradient reached an operator without a gradient formula (double backward)); the
    message names the operator, the argument, the rule and the value seen.
    """

    def __init__(self, message: str, code: int = ERR_PARAM_INVALID):
        super().__init__(message)
        self.code = int(code)

    def __reduce__(self):
        return (type(self), (str(self), self.code))
