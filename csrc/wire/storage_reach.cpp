// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/wire/storage_reach.h"

#include <c10/core/TensorImpl.h>

#include "csrc/wire/head.h"

namespace torch_rpc_ext::wire::detail {

namespace {

// True if `refs` strong references (taken from a use_count()) are all one
// holder's: either a lone C++ reference, or, for an object with a Python
// wrapper, that reference plus the wrapper's own, with the wrapper alive
// only because of it (torch keeps a wrapper alive while C++ references
// exist; see "PyObject preservation" in c10/util/intrusive_ptr.h).
bool soleHolder(size_t refs, const c10::impl::PyObjectSlot* slot) {
  if (slot->load_pyobj() == nullptr) {
    return refs == 1;
  }
  return refs == 2 && slot->has_unique_reference();
}

} // namespace

std::shared_ptr<frame::SharedRegion> regionOf(const c10::Storage& storage) {
  if (!viewsProvidedMemory(storage)) {
    return nullptr;
  }
  return static_cast<ProvidedRegion*>(storage.data_ptr().get_context())->region;
}

bool reachableOnlyThrough(const at::Tensor& t) {
  const auto& storage = t.storage();
  return soleHolder(t.use_count(), t.unsafeGetTensorImpl()->pyobj_slot()) &&
      t.weak_use_count() == 1 &&
      soleHolder(
             storage.use_count(),
             storage.unsafeGetStorageImpl()->pyobj_slot()) &&
      storage.getWeakStorageImpl().weak_use_count() == 2;
}

} // namespace torch_rpc_ext::wire::detail
