// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/common/crypto.h"

#include <sys/random.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <stdexcept>

#include "csrc/common/libcrypto.h"

namespace torch_rpc_ext {

Digest hmacSha256(std::string_view key, std::string_view message) {
  const Libcrypto& lib = libcrypto();
  if (key.size() > static_cast<size_t>(INT_MAX)) {
    throw std::invalid_argument("HMAC key longer than INT_MAX bytes");
  }
  // Never hand OpenSSL a null pointer, even for empty input.
  static const unsigned char kEmpty = 0;
  const void* k = key.empty() ? &kEmpty : static_cast<const void*>(key.data());
  const auto* m = message.empty()
      ? &kEmpty
      : reinterpret_cast<const unsigned char*>(message.data());
  Digest out;
  unsigned int size = 0;
  if (lib.hmac(
          lib.sha256,
          k,
          static_cast<int>(key.size()),
          m,
          message.size(),
          out.data(),
          &size) == nullptr ||
      size != out.size()) {
    throw std::runtime_error("libcrypto's HMAC-SHA256 failed");
  }
  return out;
}

void requireLibcrypto() {
  (void)libcrypto();
}

std::string libcryptoDescription() {
  return libcrypto().description;
}

bool constantTimeEqual(const Digest& a, const Digest& b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= a[i] ^ b[i];
  }
  return diff == 0;
}

std::string randomBytes(size_t n) {
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    ssize_t got = getrandom(out.data() + done, n - done, 0);
    if (got < 0) {
      if (errno == EINTR) {
        continue;
      }
      throw std::runtime_error(
          std::string("getrandom failed: ") + std::strerror(errno));
    }
    done += static_cast<size_t>(got);
  }
  return out;
}

} // namespace torch_rpc_ext
