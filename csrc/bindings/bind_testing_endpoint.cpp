// SPDX-License-Identifier: BSD-3-Clause
// torch_rpc_ext._testing.Endpoint: one transport connection with its
// channels and no agent above it, so tests can send frames whose segments
// live anywhere (device memory of the fake driver, say) and look at what
// the peer's channels provide, in two processes. A test hook.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "csrc/bindings/bind.h"
#include "csrc/channel/channel.h"
#include "csrc/channel/registry.h"
#include "csrc/transport/registry.h"
#include "csrc/transport/transport.h"

namespace torch_rpc_ext::bindings {

namespace {

// Memory a channel provided for a received segment, held from Python.
struct Region {
  std::shared_ptr<frame::SharedRegion> region;
  uintptr_t address = 0;
  uint64_t size = 0;
};

// (address, size, device type, device index, stream) of an outbound
// segment; the caller keeps the memory alive until the frame is written.
using SegmentSpec = std::tuple<uintptr_t, uint64_t, int, int, uintptr_t>;

class Endpoint final : public transport::ConnectionObserver {
 public:
  Endpoint(
      int32_t selfId,
      int32_t worldSize,
      const std::string& secret,
      const std::string& transportName,
      const std::vector<std::string>& channelNames,
      const std::string& encryption,
      const std::vector<std::string>& tlsFiles,
      double handshakeTimeoutSeconds,
      double heartbeatTimeoutSeconds,
      const std::vector<std::string>& holdOffExempt) {
    transport::TransportOptions o;
    o.holdOffExempt = AddressRanges::parse(holdOffExempt);
    for (const auto& name : channelNames) {
      auto c = channel::createChannel(name);
      if (!c->isViable()) {
        throw std::runtime_error(
            name + " is not viable: " + c->unviableReason());
      }
      c->exemptFromHoldOff(o.holdOffExempt);
      channels_.push_back(c);
    }
    o.selfId = selfId;
    o.peerIdLimit = worldSize;
    o.secret = secret;
    o.tls.mode = transport::parseTlsMode(encryption);
    if (handshakeTimeoutSeconds > 0) {
      o.handshakeTimeout = seconds(handshakeTimeoutSeconds);
    }
    if (heartbeatTimeoutSeconds > 0) {
      o.heartbeatTimeout =
          std::chrono::duration_cast<std::chrono::milliseconds>(
              seconds(heartbeatTimeoutSeconds));
    }
    if (tlsFiles.size() == 3) {
      o.tls.certFile = tlsFiles[0];
      o.tls.keyFile = tlsFiles[1];
      o.tls.caFile = tlsFiles[2];
    }
    o.channelsFor = [this](int32_t, bool passesDescriptors) {
      std::vector<channel::Offer> out;
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& c : channels_) {
        auto it = peerDescriptors_.find(c->name());
        if ((!c->needsDescriptorPassing() || passesDescriptors) &&
            it != peerDescriptors_.end() && c->reaches(it->second)) {
          out.push_back(channel::Offer{c, it->second});
        }
      }
      return out;
    };
    transport_ = transport::createTransport(transportName, o);
    listener_ = transport_->listen();
    listener_->start(this);
  }

  ~Endpoint() override {
    close(0);
  }

  std::string address() const {
    return listener_->address();
  }

  std::map<std::string, std::string> descriptors() const {
    std::map<std::string, std::string> out;
    for (const auto& c : channels_) {
      out[c->name()] = c->domainDescriptor();
    }
    return out;
  }

  // What the peer published, before a connection to or from it opens.
  void setPeer(const std::map<std::string, std::string>& descriptors) {
    std::lock_guard<std::mutex> lock(mu_);
    peerDescriptors_ = descriptors;
  }

  // The transport's knock on each address (a connect and a close): per
  // address, "accepted", "refused" or "unknown", and why.
  std::vector<std::pair<std::string, std::string>> knock(
      const std::vector<std::string>& addresses,
      double timeoutSeconds) {
    auto knocks = transport_->knock(
        addresses,
        std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000)));
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& k : knocks) {
      out.emplace_back(
          k.outcome == transport::Transport::Knock::kAccepted      ? "accepted"
              : k.outcome == transport::Transport::Knock::kRefused ? "refused"
                                                                   : "unknown",
          k.why);
    }
    return out;
  }

  void connect(const std::string& address, int32_t peerId) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closeReason_.clear(); // a new dial: its end is the one to say
    }
    auto dialed = transport_->connect(address, peerId, this);
    std::lock_guard<std::mutex> lock(mu_);
    dialed_ = std::move(dialed);
  }

  // Waits until a connection is ready; false on timeout, or if it closed
  // before it was ever ready. Once ready, true even if the peer has closed
  // it since (it may have sent its frames and gone: they are received).
  bool waitReady(double timeoutSeconds) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, seconds(timeoutSeconds), [&] {
      return conn_ != nullptr || !closeReason_.empty();
    });
    return conn_ != nullptr;
  }

  // `handBack[i]`: segment i lies in that received region, which nothing
  // else will use again (the channel may hand it back without a copy).
  void send(
      const std::string& head,
      const std::vector<SegmentSpec>& specs,
      const std::vector<std::optional<Region>>& handBack) {
    std::shared_ptr<transport::Connection> conn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      conn = conn_ ? conn_ : dialed_;
    }
    if (!conn) {
      throw std::runtime_error("no connection");
    }
    frame::OutboundFrame f;
    f.head = head;
    for (const auto& [address, size, device, index, stream] : specs) {
      frame::OutboundFrame::Segment s{
          reinterpret_cast<const void*>(address), size};
      s.device = static_cast<uint8_t>(device);
      s.deviceIndex = static_cast<int16_t>(index);
      s.stream = stream;
      const size_t i = f.segments.size();
      if (i < handBack.size() && handBack[i]) {
        s.origin = handBack[i]->region;
        s.exclusive = true;
      }
      f.segments.push_back(s);
    }
    if (!conn->write(std::move(f))) {
      throw std::runtime_error("connection closed: " + conn->closeReason());
    }
  }

  // (head, segments): a segment is bytes, a Region for provided memory, or
  // "failed: <why>" where it could not land.
  // None on timeout, or at once when the connection has closed and every
  // frame it delivered has been received (close_reason() says why).
  py::object receive(double timeoutSeconds) {
    Inbound in;
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, seconds(timeoutSeconds), [&] {
        return !inbound_.empty() || !closeReason_.empty();
      });
      if (inbound_.empty()) {
        return py::none();
      }
      in = std::move(inbound_.front());
      inbound_.pop_front();
    }
    py::list segments;
    for (size_t i = 0; i < in.sizes.size(); ++i) {
      const auto* failed = in.buffers.regions.size() > i
          ? dynamic_cast<const frame::FailedRegion*>(
                in.buffers.regions[i].get())
          : nullptr;
      if (failed != nullptr) {
        // A segment that could not land (a message the agent would fail).
        segments.append(py::str("failed: " + failed->why()));
      } else if (in.buffers.provided.size() > i && in.buffers.provided[i]) {
        segments.append(
            Region{
                in.buffers.regions[i],
                reinterpret_cast<uintptr_t>(in.buffers.provided[i]),
                in.sizes[i]});
      } else {
        segments.append(py::bytes(in.data[i].data(), in.data[i].size()));
      }
    }
    return py::make_tuple(py::bytes(in.head), segments);
  }

  std::string closeReason() {
    std::lock_guard<std::mutex> lock(mu_);
    return closeReason_;
  }

  // The ready connection's security() ("" in the clear or when none).
  std::string security() {
    std::lock_guard<std::mutex> lock(mu_);
    return conn_ ? conn_->security() : std::string();
  }

  std::map<std::string, std::map<std::string, uint64_t>> counters() const {
    std::map<std::string, std::map<std::string, uint64_t>> out;
    for (const auto& c : channels_) {
      out[c->name()] = c->counters();
    }
    if (transport_) {
      out["transport"] = transport_->counters(); // beside the channels'
    }
    return out;
  }

  // Waits (at most `drainSeconds`) until the frames already queued are
  // written, then closes: a connection's close() drops queued frames, and
  // the peer may be waiting for the last one.
  void close(double drainSeconds) {
    std::shared_ptr<transport::Connection> conn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      conn = conn_;
    }
    const auto deadline =
        std::chrono::steady_clock::now() + seconds(drainSeconds);
    while (conn && !conn->isClosed() && conn->hasQueuedWrites() &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (transport_) {
      transport_->stop();
    }
    std::lock_guard<std::mutex> lock(mu_);
    conn_.reset();
    dialed_.reset();
    inbound_.clear();
  }

  // ---- ConnectionObserver (loop thread) ----
  void onReady(const std::shared_ptr<transport::Connection>& conn) override {
    std::lock_guard<std::mutex> lock(mu_);
    conn_ = conn;
    closeReason_.clear(); // a new connection: the endpoint is live again
    cv_.notify_all();
  }

  frame::InboundBuffers onFrameHead(
      transport::Connection&,
      const std::string&,
      const std::vector<uint64_t>& sizes,
      const std::vector<bool>& provided) override {
    auto data = std::make_shared<Received>();
    frame::InboundBuffers b;
    data->sizes = sizes;
    for (size_t i = 0; i < sizes.size(); ++i) {
      // `provided` is empty when no channel provided memory for any.
      bool byChannel = i < provided.size() && provided[i];
      data->bytes.emplace_back(byChannel ? 0 : sizes[i]);
      b.segments.push_back(byChannel ? nullptr : data->bytes.back().data());
    }
    // A staging channel lands device bytes on this device (-1: refuse).
    b.devices.assign(sizes.size(), landingDevice_.load());
    b.keepAlive = data;
    return b;
  }

  void setLandingDevice(int device) {
    landingDevice_ = static_cast<int8_t>(device);
  }

  void onFrame(
      const std::shared_ptr<transport::Connection>&,
      std::string head,
      frame::InboundBuffers buffers) override {
    Inbound in;
    in.head = std::move(head);
    auto data = std::static_pointer_cast<Received>(buffers.keepAlive);
    in.sizes = std::move(data->sizes);
    in.data = std::move(data->bytes);
    in.buffers = std::move(buffers);
    std::lock_guard<std::mutex> lock(mu_);
    inbound_.push_back(std::move(in));
    cv_.notify_all();
  }

  void onClosed(transport::Connection& conn, const std::string& reason)
      override {
    std::lock_guard<std::mutex> lock(mu_);
    closeReason_ = reason.empty() ? "closed" : reason;
    cv_.notify_all();
  }

 private:
  static std::chrono::milliseconds seconds(double s) {
    return std::chrono::milliseconds(int64_t(s * 1000));
  }

  // A frame's segments as they arrive: the announced sizes, and a buffer
  // for each one the stream carries.
  struct Received {
    std::vector<uint64_t> sizes;
    std::vector<std::vector<char>> bytes;
  };
  struct Inbound {
    std::string head;
    std::vector<uint64_t> sizes;
    std::vector<std::vector<char>> data;
    frame::InboundBuffers buffers;
  };

  std::vector<std::shared_ptr<channel::Context>> channels_;
  std::atomic<int8_t> landingDevice_{0};
  std::shared_ptr<transport::Transport> transport_;
  std::shared_ptr<transport::Listener> listener_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> peerDescriptors_;
  std::shared_ptr<transport::Connection> conn_;
  // What connect() dialed: send() writes to it before it is ready (the
  // frames wait for the handshake), as the agent does to a peer it dials.
  std::shared_ptr<transport::Connection> dialed_;
  std::deque<Inbound> inbound_;
  std::string closeReason_;
};

} // namespace

void bindTestingEndpoint(py::module_& m) {
  py::class_<Region>(m, "Region")
      .def_readonly("address", &Region::address)
      .def_readonly("size", &Region::size)
      .def_property_readonly(
          "device",
          [](const Region& r) -> py::object {
            auto* d = dynamic_cast<channel::DeviceRegion*>(r.region.get());
            return d ? py::object(py::int_(d->device())) : py::none();
          })
      .def(
          "wait_on",
          [](Region& r, uintptr_t stream) {
            auto* d = dynamic_cast<channel::DeviceRegion*>(r.region.get());
            if (d == nullptr) {
              throw py::type_error("not device memory");
            }
            d->waitOn(stream);
          },
          py::call_guard<py::gil_scoped_release>())
      // Drop our hold: the channel takes the memory back once nothing else
      // holds it.
      .def(
          "release",
          [](Region& r) { r.region.reset(); },
          py::call_guard<py::gil_scoped_release>());

  // Without the GIL: an Endpoint dropped without close() stops its loop,
  // whose threads take the GIL on their way out (python_threads.cpp).
  py::class_<Endpoint>(m, "Endpoint", py::release_gil_before_calling_cpp_dtor())
      .def(
          py::init<
              int32_t,
              int32_t,
              const std::string&,
              const std::string&,
              const std::vector<std::string>&,
              const std::string&,
              const std::vector<std::string>&,
              double,
              double,
              const std::vector<std::string>&>(),
          py::arg("self_id"),
          py::arg("world_size"),
          py::arg("secret"),
          py::arg("transport"),
          py::arg("channels"),
          py::arg("encryption") = "auto",
          py::arg("tls_files") = std::vector<std::string>{},
          py::arg("handshake_timeout") = 0.0,
          py::arg("heartbeat_timeout") = 0.0,
          py::arg("hold_off_exempt") = std::vector<std::string>{},
          // (A constructor that throws stops the loop it started.)
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("address", &Endpoint::address)
      .def("descriptors", &Endpoint::descriptors)
      .def("set_peer", &Endpoint::setPeer)
      .def("connect", &Endpoint::connect)
      .def(
          "knock",
          &Endpoint::knock,
          py::arg("addresses"),
          py::arg("timeout"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "wait_ready",
          &Endpoint::waitReady,
          py::call_guard<py::gil_scoped_release>())
      .def(
          "send",
          &Endpoint::send,
          py::arg("head"),
          py::arg("segments"),
          py::arg("hand_back") = std::vector<std::optional<Region>>{},
          py::call_guard<py::gil_scoped_release>())
      .def("receive", &Endpoint::receive, py::arg("timeout"))
      .def("close_reason", &Endpoint::closeReason)
      .def("security", &Endpoint::security)
      .def("counters", &Endpoint::counters)
      .def("set_landing_device", &Endpoint::setLandingDevice)
      .def(
          "close",
          &Endpoint::close,
          py::arg("drain_seconds") = 5.0,
          py::call_guard<py::gil_scoped_release>());
}

} // namespace torch_rpc_ext::bindings
