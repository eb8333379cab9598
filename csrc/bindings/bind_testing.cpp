// SPDX-License-Identifier: BSD-3-Clause
// torch_rpc_ext._testing (testing_module.cpp): the codec, frame checks and
// crypto, reachable from pytest without processes. For tests only.
#include <torch/csrc/distributed/rpc/message.h>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "csrc/agent/builtin_call.h"
#include "csrc/bindings/bind.h"
#include "csrc/channel/shm/slab.h"
#include "csrc/common/aes_gcm_vaes.h"
#include "csrc/common/buffer_pool.h"
#include "csrc/common/cpace.h"
#include "csrc/common/crypto.h"
#include "csrc/common/fd_closer.h"
#include "csrc/common/host_load.h"
#include "csrc/common/log_route.h"
#include "csrc/common/logging.h"
#include "csrc/common/thread_pool.h"
#include "csrc/frame/frame.h"
#include "csrc/transport/handshake.h"
#include "csrc/transport/stream/address.h"
#include "csrc/transport/stream/loop.h"
#include "csrc/transport/transport.h"
#include "csrc/wire/codec.h"

namespace torch_rpc_ext::bindings {

namespace {

namespace rpc = torch::distributed::rpc;

py::bytes digestBytes(const Digest& d) {
  return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
}

} // namespace

void bindTesting(py::module_& m) {
  // A line as the agent logs one, from a thread of ours (not Python's).
  m.def(
      "log",
      [](bool warning, const std::string& line, int times) {
        std::thread([=] {
          for (int i = 0; i < times; ++i) {
            warning ? logWarning(line) : logDebug(line);
          }
        }).join();
      },
      py::arg("warning"),
      py::arg("line"),
      py::arg("times") = 1,
      py::call_guard<py::gil_scoped_release>());
  m.def("log_json_string", [](const py::bytes& text) {
    return py::bytes(jsonString(std::string(text)));
  });
  m.def(
      "python_thread_states",
      [] {
        size_t n = 0;
        for (auto* t = PyInterpreterState_ThreadHead(PyInterpreterState_Get());
             t != nullptr;
             t = PyThreadState_Next(t)) {
          ++n;
        }
        return n;
      },
      "How many Python thread states this interpreter has now.");
  // Raise RuntimeError (the text of requireLibcrypto) without libcrypto.
  m.def("hmac_sha256", [](const py::bytes& key, const py::bytes& msg) {
    return digestBytes(hmacSha256(key, msg));
  });
  m.def("libcrypto", &libcryptoDescription);
  // The key exchange before TLS (common/cpace.h): Elligator 2's map of a
  // 32-byte little-endian field element, a session's generator, and one end
  // of an exchange (.share, .finish(peer_share, client)).
  m.def("elligator2", [](const py::bytes& r) {
    return py::bytes(cpace::mapToCurve25519(std::string(r)));
  });
  m.def("cpace_generator", [](const py::bytes& key, const py::bytes& sid) {
    return py::bytes(cpace::generator(std::string(key), std::string(sid)));
  });
  py::class_<cpace::Exchange>(m, "CpaceExchange")
      .def(py::init([](const py::bytes& key, const py::bytes& sid) {
        return std::make_unique<cpace::Exchange>(
            std::string(key), std::string(sid));
      }))
      .def_property_readonly(
          "share",
          [](const cpace::Exchange& e) { return py::bytes(e.share()); })
      .def(
          "finish",
          [](const cpace::Exchange& e, const py::bytes& peer, bool client) {
            return py::bytes(e.finish(std::string(peer), client));
          },
          py::arg("peer_share"),
          py::arg("client"));
  m.def(
      "hkdf_expand",
      [](const py::bytes& prk, const py::bytes& info, size_t length) {
        return py::bytes(hkdfExpand(prk, info, length));
      });
  // AES-128-GCM as the lanes use it (common/crypto.h, Aead): (ciphertext,
  // tag), and the plaintext or None when the tag does not match. `engine`:
  // "auto" (Aead::defaultEngine), "vaes" or "libcrypto"; `in_place` opens
  // the bytes where they lie, as the lanes' receiver does.
  auto engineOf = [](const std::string& name) {
    if (name == "auto") {
      return Aead::Engine::kAuto;
    }
    if (name == "vaes") {
      return Aead::Engine::kVaes;
    }
    if (name == "libcrypto") {
      return Aead::Engine::kLibcrypto;
    }
    throw std::invalid_argument("engine: auto, vaes or libcrypto");
  };
  m.def(
      "aead_seal",
      [engineOf](
          const py::bytes& key,
          const py::bytes& nonce,
          const py::bytes& aad,
          const py::bytes& plain,
          const std::string& engine) {
        std::string k = key, n = nonce, a = aad, p = plain;
        if (n.size() != Aead::kNonceBytes) {
          throw std::invalid_argument("the nonce is 12 bytes");
        }
        Aead aead(k, engineOf(engine));
        std::string out(p.size(), '\0');
        std::string tag(Aead::kTagBytes, '\0');
        aead.seal(
            reinterpret_cast<const uint8_t*>(n.data()),
            a,
            p.data(),
            out.data(),
            p.size(),
            reinterpret_cast<uint8_t*>(tag.data()));
        return py::make_tuple(py::bytes(out), py::bytes(tag));
      },
      py::arg("key"),
      py::arg("nonce"),
      py::arg("aad"),
      py::arg("plain"),
      py::arg("engine") = "auto");
  m.def(
      "aead_open",
      [engineOf](
          const py::bytes& key,
          const py::bytes& nonce,
          const py::bytes& aad,
          const py::bytes& sealed,
          const py::bytes& tag,
          const std::string& engine,
          bool inPlace) -> py::object {
        std::string k = key, n = nonce, a = aad, c = sealed, t = tag;
        if (n.size() != Aead::kNonceBytes || t.size() != Aead::kTagBytes) {
          throw std::invalid_argument("the nonce is 12 bytes, the tag 16");
        }
        Aead aead(k, engineOf(engine));
        std::string out(inPlace ? 0 : c.size(), '\0');
        std::string& into = inPlace ? c : out;
        if (!aead.open(
                reinterpret_cast<const uint8_t*>(n.data()),
                a,
                c.data(),
                into.data(),
                c.size(),
                reinterpret_cast<const uint8_t*>(t.data()))) {
          return py::none();
        }
        return py::bytes(into);
      },
      py::arg("key"),
      py::arg("nonce"),
      py::arg("aad"),
      py::arg("sealed"),
      py::arg("tag"),
      py::arg("engine") = "auto",
      py::arg("in_place") = false);
  // Seconds to seal (or open in place) `total` bytes as records of
  // `record` bytes under `engine`, as the lanes do (the best of `rounds`,
  // GIL released): benchmarks/aead_bench.py's figure, with no Python or
  // copy between records. Opening here skips the tag check's outcome (the
  // bytes are not a real record), not its work.
  m.def(
      "aead_seconds",
      [engineOf](
          const std::string& engine,
          bool open,
          size_t record,
          size_t total,
          int rounds) {
        if (record == 0 || total < record || rounds < 1) {
          throw std::invalid_argument(
              "record > 0, total >= record, rounds >= 1");
        }
        Aead aead(std::string(Aead::kKeyBytes, '\x5a'), engineOf(engine));
        std::vector<uint8_t> data(total, 7);
        std::vector<uint8_t> out(record + Aead::kTagBytes);
        uint8_t nonce[Aead::kNonceBytes] = {};
        uint8_t tag[Aead::kTagBytes] = {};
        const std::string header(32, 'h');
        py::gil_scoped_release release;
        double best = 0;
        for (int r = 0; r < rounds; ++r) {
          auto t0 = std::chrono::steady_clock::now();
          for (size_t at = 0; at + record <= total; at += record) {
            if (open) {
              (void)aead.open(nonce, header, &data[at], &data[at], record, tag);
            } else {
              aead.seal(nonce, header, &data[at], out.data(), record, tag);
            }
          }
          double s = std::chrono::duration<double>(
                         std::chrono::steady_clock::now() - t0)
                         .count();
          best = r == 0 ? s : std::min(best, s);
        }
        return best;
      },
      py::arg("engine"),
      py::arg("open"),
      py::arg("record"),
      py::arg("total"),
      py::arg("rounds"));
  // The engine an Aead made with kAuto uses here (the env var read now),
  // and whether this CPU runs ours.
  m.def("aead_engine", [] {
    return std::string(Aead::engineName(Aead::defaultEngine()));
  });
  m.def("aes_gcm_vaes_supported", &aes_gcm_vaes::supported);
  // The closers of descriptors a peer handed us (fd_closer.h): take
  // ownership of `fds` and close them off this thread; their counts.
  m.def("close_peer_fds", [](std::vector<int> fds) { closeOffThread(fds); });
  // What the host's CPU pressure reads as (None: the kernel's), for the
  // handshake's, the heartbeat's and tcp_lanes' allowances (host_load.h).
  m.def(
      "set_cpu_pressure",
      [](std::optional<double> percent) { setCpuPressureForTests(percent); },
      py::arg("percent"));
  // The bytes of slabs this process lets a connection announce to its
  // peer, and accepts from one (twice it): 0 puts back 32 GiB (slab.h).
  m.def(
      "set_slab_bytes_bound",
      [](uint64_t bytes) { channel::shm::setSlabBytesBound(bytes); },
      py::arg("bytes"));
  m.def("peer_fd_stats", [] {
    auto s = fdCloserStats();
    return py::dict(
        py::arg("closed") = s.closed,
        py::arg("pending") = s.pending,
        py::arg("via_children") = s.viaChildren,
        py::arg("children") = s.children,
        py::arg("hand_over") = s.handOver);
  });
  // How a worker listening on `self` reaches a peer that advertised `peer`
  // (stream::routeFrom): ValueError saying why it cannot.
  m.def("route_from", &transport::stream::routeFrom);

  // (head, [segments]) of the frame that would carry this message.
  m.def(
      "encode_message",
      [](int type,
         const py::bytes& payload,
         const std::vector<at::Tensor>& tensors,
         int64_t id) {
        std::string p = payload;
        auto msg = c10::make_intrusive<rpc::Message>(
            std::vector<char>(p.begin(), p.end()),
            std::vector<at::Tensor>(tensors),
            static_cast<rpc::MessageType>(type),
            -1);
        auto frame = wire::encodeMessage(msg, id);
        py::list segments;
        for (const auto& s : frame.segments) {
          segments.append(py::bytes(static_cast<const char*>(s.data), s.size));
        }
        return py::make_tuple(py::bytes(frame.head), segments);
      });

  // Decode (head, [segments]) as the receiving agent would; raises
  // ValueError for anything the agent would reject.
  m.def(
      "decode_message",
      [](const py::bytes& head, const std::vector<py::bytes>& segments) {
        std::vector<std::string> segs;
        std::vector<uint64_t> sizes;
        for (const auto& s : segments) {
          segs.emplace_back(s);
          sizes.push_back(segs.back().size());
        }
        std::shared_ptr<wire::InboundMessage> in;
        c10::intrusive_ptr<rpc::Message> msg;
        try {
          in = wire::InboundMessage::prepare(head, sizes);
          auto buffers = in->buffers(in);
          for (size_t i = 0; i < segs.size(); ++i) {
            if (!segs[i].empty()) {
              std::memcpy(buffers.segments[i], segs[i].data(), segs[i].size());
            }
          }
          msg = in->finish();
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        } catch (const c10::Error& e) {
          throw py::value_error(e.what_without_backtrace());
        }
        const auto& p = msg->payload();
        return py::make_tuple(
            static_cast<int>(msg->type()),
            msg->id(),
            py::bytes(p.data(), p.size()),
            msg->tensors());
      });

  // "" if a 24-byte frame header is acceptable, else the reason.
  m.def("validate_header", [](const py::bytes& raw, uint64_t maxFrameBytes) {
    std::string s = raw;
    if (s.size() != sizeof(frame::FrameHeader)) {
      throw py::value_error("a frame header is 24 bytes");
    }
    frame::FrameHeader h;
    std::memcpy(&h, s.data(), sizeof(h));
    frame::FrameLimits limits;
    limits.maxFrameBytes = maxFrameBytes;
    return frame::validateHeader(h, limits);
  });

  // Post `n` tasks to a pool of `core` threads, each blocking until the next
  // one has started (as nested RPCs do). Returns (all finished, pool size).
  m.def(
      "pool_chain",
      [](size_t core, int n, double timeoutSeconds, double stallMs) {
        std::mutex mu;
        std::condition_variable cv;
        std::vector<char> started(n + 1, 0);
        started[n] = 1;
        int done = 0;
        auto deadline = std::chrono::steady_clock::now() +
            std::chrono::milliseconds(int64_t(timeoutSeconds * 1000));
        size_t size = 0;
        {
          ThreadPool pool(
              core,
              1024,
              std::chrono::milliseconds(static_cast<int64_t>(stallMs)));
          for (int i = 0; i < n; ++i) {
            pool.run([&, i] {
              std::unique_lock<std::mutex> lock(mu);
              started[i] = 1;
              cv.notify_all();
              cv.wait_until(
                  lock, deadline, [&] { return started[i + 1] != 0; });
              ++done;
              cv.notify_all();
            });
          }
          std::unique_lock<std::mutex> lock(mu);
          cv.wait_until(lock, deadline, [&] { return done == n; });
          size = pool.size();
        }
        return std::make_pair(done == n, size);
      },
      py::arg("core"),
      py::arg("n"),
      py::arg("timeout"),
      py::arg("stall_ms") = 20.0,
      py::call_guard<py::gil_scoped_release>());

  // Called holding the GIL, which a pool worker's exit hook waits for
  // (python_threads.cpp): stop a one-thread pool from one thread, post a
  // task once its worker has decided to exit, stop it from a second thread,
  // and let the GIL go after `holdSeconds`. Returns what each stop() saw on
  // return and what became of the late task.
  m.def("pool_stops_while_its_worker_exits", [](double holdSeconds) {
    auto pool = std::make_unique<ThreadPool>(1, 1);
    auto waitFor = [](auto ready) {
      auto deadline =
          std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!ready() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return ready();
    };
    if (!waitFor([&] { return pool->idle() == 1; })) {
      throw std::runtime_error("the pool's worker never became idle");
    }
    std::atomic<int64_t> sizeAtFirst{-1};
    std::atomic<int64_t> sizeAtSecond{-1};
    std::thread first([&] {
      pool->stop();
      sizeAtFirst = static_cast<int64_t>(pool->size());
    });
    // Woken by stop(), it leaves the loop under the pool's lock: idle 0.
    bool exiting = waitFor([&] { return pool->idle() == 0; });
    auto token = std::make_shared<int>(0);
    std::weak_ptr<int> late = token;
    std::atomic<bool> ran{false};
    pool->run([token = std::move(token), &ran] { ran = true; });
    std::thread second([&] {
      pool->stop();
      sizeAtSecond = static_cast<int64_t>(pool->size());
    });
    std::this_thread::sleep_for(
        std::chrono::milliseconds(static_cast<int64_t>(holdSeconds * 1000)));
    size_t queued = 0;
    {
      py::gil_scoped_release release;
      first.join();
      second.join();
      queued = pool->queued();
    }
    py::dict out;
    out["worker_was_exiting"] = exiting;
    out["size_at_first_return"] = sizeAtFirst.load();
    out["size_at_second_return"] = sizeAtSecond.load();
    out["late_task_ran"] = ran.load();
    out["late_task_released"] = late.expired();
    out["queued_after_stop"] = queued;
    return out;
  });

  // From the loop thread, defer `n` pieces of work, each blocking until the
  // next one has started (a UDF waiting on a nested RPC whose response is
  // queued behind it). One loop thread alone deadlocks for any n > 1.
  // Returns (all finished, takeovers, every piece saw inLoop() false).
  m.def(
      "loop_chain",
      [](int n, double timeoutSeconds) {
        std::mutex mu;
        std::condition_variable cv;
        std::vector<char> started(n + 1, 0);
        started[n] = 1;
        int done = 0;
        bool outsideLoop = true;
        auto deadline = std::chrono::steady_clock::now() +
            std::chrono::milliseconds(int64_t(timeoutSeconds * 1000));
        uint64_t takeovers = 0;
        {
          transport::stream::Loop loop;
          loop.post([&] {
            for (int i = 0; i < n; ++i) {
              loop.runAfterDispatch([&, i] {
                std::unique_lock<std::mutex> lock(mu);
                outsideLoop = outsideLoop && !loop.inLoop();
                started[i] = 1;
                cv.notify_all();
                cv.wait_until(
                    lock, deadline, [&] { return started[i + 1] != 0; });
                ++done;
                cv.notify_all();
              });
            }
          });
          {
            std::unique_lock<std::mutex> lock(mu);
            cv.wait_until(lock, deadline, [&] { return done == n; });
          }
          takeovers = loop.takeovers();
        }
        return std::make_tuple(done == n, takeovers, outsideLoop);
      },
      py::call_guard<py::gil_scoped_release>());

  // Defer `n` pieces (the first sleeps `sleepMs`), then stop the loop at once.
  // Returns how many ran by the time stop() returned: deferred work is never
  // dropped.
  m.def(
      "loop_stop_runs_deferred",
      [](int n, int sleepMs) {
        std::atomic<int> ran{0};
        {
          transport::stream::Loop loop;
          loop.post([&] {
            for (int i = 0; i < n; ++i) {
              loop.runAfterDispatch([&, i] {
                if (i == 0) {
                  std::this_thread::sleep_for(
                      std::chrono::milliseconds(sleepMs));
                }
                ran.fetch_add(1);
              });
            }
          });
          // Let the posted piece be picked up, then stop while it runs.
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
          loop.stop();
        }
        return ran.load();
      },
      py::call_guard<py::gil_scoped_release>());

  // The receive-buffer pool, driven from Python.
  py::class_<BufferPool, std::shared_ptr<BufferPool>>(m, "BufferPool")
      .def(py::init([](size_t maxCached, double idleSeconds) {
        return std::make_shared<BufferPool>(
            maxCached, std::chrono::milliseconds(int64_t(idleSeconds * 1000)));
      }))
      .def(
          "acquire",
          [](BufferPool& p, size_t size) {
            auto b = p.acquire(size);
            // Touch every page so reuse can be told apart from a new mapping.
            std::memset(b.data, 0x5a, size);
            return py::make_tuple(
                reinterpret_cast<uintptr_t>(b.data), b.capacity);
          })
      .def(
          "release",
          [](BufferPool& p, uintptr_t data, size_t capacity) {
            p.release({reinterpret_cast<void*>(data), capacity});
          })
      .def("trim", &BufferPool::trim, py::arg("all") = false)
      .def_property_readonly("cached_bytes", &BufferPool::cachedBytes)
      .def_property_readonly("live_blocks", &BufferPool::liveBlocks);

  m.attr("FRAME_MAGIC") = frame::kFrameMagic;
  m.attr("PROTOCOL_VERSION") = frame::kProtocolVersion;
  // The defaults of a TransportOptions nobody set, in option_spec()'s units.
  m.def("transport_option_defaults", [] {
    transport::TransportOptions o;
    py::dict d;
    d["max_frame_bytes"] = o.limits.maxFrameBytes;
    d["handshake_timeout"] =
        std::chrono::duration<double>(o.handshakeTimeout).count();
    d["heartbeat_timeout"] =
        std::chrono::duration<double>(o.heartbeatTimeout).count();
    d["busy_poll_us"] = o.busyPoll.count();
    d["shm_frame_ring_bytes"] = o.frameRingBytes;
    return d;
  });
  // Whether `source` lies in the networks `entries` (hold_off_exempt).
  m.def(
      "address_ranges_contain",
      [](const std::vector<std::string>& entries, const std::string& source) {
        return AddressRanges::parse(entries).contains(source);
      });

  // The request of a builtin call, as (payload, tensors), made by ours or
  // (`torchs`) by torch's ScriptCall (builtin_call.h).
  m.def(
      "builtin_request",
      [](const std::string& opName,
         bool torchs,
         const py::args& args,
         const py::kwargs& kwargs) {
        auto [op, stack] = torch::jit::getOpWithStack(
            torch::jit::getAllOperatorsFor(c10::Symbol::fromQualString(opName)),
            args,
            kwargs);
        auto [payload, tensors] =
            builtin_call::requestForTest(op, std::move(stack), torchs);
        return py::make_tuple(
            py::bytes(payload.data(), payload.size()), std::move(tensors));
      });
}

} // namespace torch_rpc_ext::bindings
