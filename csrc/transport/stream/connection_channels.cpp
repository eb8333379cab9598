// SPDX-License-Identifier: BSD-3-Clause
// StreamConnection's channels (channel.h): opened once the peer is known,
// their settling before a close, and their housekeeping on each heartbeat
// tick.
#include <algorithm>
#include <memory>
#include <mutex>
#include <string>

#include "csrc/transport/stream/connection.h"

namespace torch_rpc_ext::transport::stream {

void StreamConnection::openChannels(int32_t peerId) {
  if (!options_.channelsFor) {
    return;
  }
  // The channels talk to their peer through us, for as long as we live.
  std::weak_ptr<channel::Host> host =
      std::static_pointer_cast<channel::Host>(shared_from_this());
  // A frame ring's offer comes with two descriptors (connection_ring.cpp).
  size_t perFrame = passesDescriptors() ? 2 : 0;
  for (const auto& offer : options_.channelsFor(peerId, passesDescriptors())) {
    channels_.push_back(offer.context->open(host, offer.peerDescriptor));
    perFrame = std::max(perFrame, channels_.back()->maxPendingFds());
  }
  // A frame's descriptors come with its first byte and wait until it is
  // parsed, and a read ends after the first bytes that bring descriptors
  // (the kernel's rule for Unix sockets): a read that ended inside one
  // frame and the next, which brings the rest of it and the next frame's
  // descriptors, leave two frames' worth waiting. (Until session 94, the
  // channels' sum, at least 2: a ring setup split so, then the frame ring's
  // offer, was four of three, and closed the connection.)
  maxFdsPerFrame_ = passesDescriptors() ? perFrame : 0;
  maxPendingFds_ = 2 * maxFdsPerFrame_;
}

uint8_t StreamConnection::channelSlot(uint8_t wireId) const {
  for (size_t k = 0; k < channels_.size(); ++k) {
    if (channels_[k]->context().wireId() == wireId) {
      return static_cast<uint8_t>(k + 1);
    }
  }
  return 0;
}

void StreamConnection::settleChannels() {
  std::weak_ptr<StreamConnection> weak =
      std::static_pointer_cast<StreamConnection>(shared_from_this());
  // Not settled before the channels have been asked, on the loop.
  settlesPending_.fetch_add(1);
  loop_.post([weak] {
    auto self = weak.lock();
    if (!self) {
      return;
    }
    if (self->isReady()) {
      for (auto& ch : self->channels_) {
        ch->settleFromLoop();
      }
    }
    self->settlesPending_.fetch_sub(1);
  });
}

bool StreamConnection::channelsSettled() {
  // channels_ is set before the connection is ready and never changes
  // after (the writers read it off the loop the same way).
  if (!isReady()) {
    return true; // closed: nothing left to give back through it
  }
  if (settlesPending_.load() != 0) {
    return false;
  }
  return std::all_of(channels_.begin(), channels_.end(), [](const auto& ch) {
    return ch->settled();
  });
}

void StreamConnection::tickChannelsFromLoop() {
  for (auto& ch : channels_) {
    ch->onTickFromLoop();
  }
  // A chunk channel no queued frame still means to use may let its
  // resources go (an idle ring).
  std::string error;
  {
    std::lock_guard<std::mutex> lock(writeMutex_);
    if (state_ != State::kReady) {
      return;
    }
    for (size_t k = 0; k < channels_.size(); ++k) {
      if (channels_[k]->context().mode() != channel::Channel::Mode::kChunks) {
        continue;
      }
      bool used =
          std::any_of(writes_.begin(), writes_.end(), [&](const auto& w) {
            return std::find(
                       w.chunked.begin(), w.chunked.end(), uint8_t(k + 1)) !=
                w.chunked.end();
          });
      if (used) {
        continue;
      }
      if (auto drop = channels_[k]->dropIfIdleLocked()) {
        writes_.push_back(controlFrame(std::move(*drop)));
        if (writes_.size() == 1) {
          error = flushLocked();
        }
      }
    }
  }
  afterFlush(error);
}

} // namespace torch_rpc_ext::transport::stream
