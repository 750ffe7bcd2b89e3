#!/usr/bin/env bash
# Fails if the shared library exports a symbol outside the public API: allowed are the C
# entry points (acl*, moegrad*), namespace moegrad (demangled "moegrad::...") and the
# typeinfo / typeinfo name / vtable of moegrad types. Linker-defined markers (_init, _fini,
# _edata, _end, __bss_start) are not the library's own symbols and are ignored.
# Usage: check_exports.sh <libmoegrad.so> [nm] [c++filt]
set -euo pipefail
lib=$1
nm=${2:-nm}
cxxfilt=${3:-c++filt}

mangled=$("$nm" -D --defined-only "$lib" | awk 'NF >= 3 { print $3 }')
if [[ -z $mangled ]]; then
  echo "no exported symbols found in $lib" >&2
  exit 1
fi
demangled=$(printf '%s\n' "$mangled" | "$cxxfilt")

bad=0
total=0
while IFS=$'\t' read -r m d; do
  total=$((total + 1))
  case $m in
    acl*|moegrad*|_init|_fini|_edata|_end|__bss_start) continue ;;
  esac
  case $d in
    moegrad::*|"typeinfo for moegrad::"*|"typeinfo name for moegrad::"*|"vtable for moegrad::"*) continue ;;
  esac
  echo "non-public exported symbol: $m"
  echo "    demangled: $d"
  bad=$((bad + 1))
done < <(paste <(printf '%s\n' "$mangled") <(printf '%s\n' "$demangled"))

# The public C API must actually be there.
for want in aclCreateTensor aclDestroyTensor aclGetRecentErrMsg aclSetAclOpExecutorRepeatable \
            aclDestroyAclOpExecutor moegradSetNumThreads moegradGetNumThreads moegradVersion \
            aclnnMoeGatingTopKGetWorkspaceSize aclnnMoeGatingTopK \
            aclnnMoeGatingTopKBackwardGetWorkspaceSize aclnnMoeGatingTopKBackward \
            aclnnMoeFinalizeRoutingV2GetWorkspaceSize aclnnMoeFinalizeRoutingV2 \
            aclnnMoeFinalizeRoutingV2GradGetWorkspaceSize aclnnMoeFinalizeRoutingV2Grad \
            aclnnSwigluGroupQuantGradGetWorkspaceSize aclnnSwigluGroupQuantGrad \
            aclnnSwigluGroupGetWorkspaceSize aclnnSwigluGroup \
            aclnnMoeFinalizeRoutingBiasGradGetWorkspaceSize aclnnMoeFinalizeRoutingBiasGrad \
            aclnnSwigluGroupQuantGetWorkspaceSize aclnnSwigluGroupQuant; do
  if ! grep -qx "$want" <<<"$mangled"; then
    echo "missing public C symbol: $want"
    bad=$((bad + 1))
  fi
done

echo "$total exported symbols checked, $bad problem(s)"
[[ $bad -eq 0 ]]
