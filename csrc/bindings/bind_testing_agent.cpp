// SPDX-License-Identifier: BSD-3-Clause
// torch_rpc_ext._testing.agent: the agent's parts driven alone, without
// processes or transports (tests/unit/test_agent_parts.py). A Group runs
// its real log, watcher and leases against a store the test hands it (a
// HashStore), with a GroupListener that records what it hears; the
// RRefGuard's fork attribution runs on messages and bytes the test makes;
// a loop of the live agent blocked (stall_loop); and the table of requests
// being served, driven alone and timed (ServingTable). For tests only.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "csrc/agent/agent.h"
#include "csrc/agent/group.h"
#include "csrc/agent/rref_guard.h"
#include "csrc/agent/serving_table.h"
#include "csrc/bindings/bind.h"

namespace torch_rpc_ext::bindings {

namespace {

namespace rpc = torch::distributed::rpc;

// A GroupListener with no transport: every worker is routed to "fake" at
// the address its offers name; probes answer as the test says.
class RecordingListener final : public GroupListener {
 public:
  explicit RecordingListener(bool answers) : answers_(answers) {}

  Route routeFor(const std::string& name, const std::string& offers) override {
    Route r;
    r.transport = "fake";
    r.address = offers;
    return r;
  }
  Probe probe(const Peer& peer) override {
    std::lock_guard<std::mutex> lock(mutex_);
    probes_.push_back(peer.info.name_);
    return answers_ ? Probe::kReady : Probe::kUnreachable;
  }
  std::vector<std::string> whyUnreachable(
      const std::vector<const Peer*>& peers,
      std::chrono::milliseconds,
      bool) override {
    return std::vector<std::string>(peers.size());
  }
  bool listenerAnswers(
      const std::string&,
      const std::string&,
      std::chrono::milliseconds) override {
    return answers_;
  }
  void onDeparted(const Peer& peer, bool dead) override {
    std::lock_guard<std::mutex> lock(mutex_);
    departed_.emplace_back(peer.info.name_, dead, peer.departure());
  }
  void onFenced(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(mutex_);
    fenced_ = reason;
  }
  void reserveIds(int32_t rank, int64_t generation) override {
    std::lock_guard<std::mutex> lock(mutex_);
    reserved_.emplace_back(rank, generation);
  }
  int64_t callsBeingServed() override {
    return 0;
  }

  const bool answers_;
  std::mutex mutex_;
  std::vector<std::string> probes_;
  std::vector<std::tuple<std::string, bool, std::string>> departed_;
  std::string fenced_;
  std::vector<std::pair<int32_t, int64_t>> reserved_;
};

// One member: its options, its listener, its Group.
struct GroupHarness {
  GroupHarness(
      const c10::intrusive_ptr<::c10d::Store>& store,
      const std::string& name,
      int rank,
      int worldSize,
      double leaseSeconds,
      bool answers,
      const std::string& secret,
      double rendezvousSeconds)
      : name(name), listener(answers) {
    options.secret = secret;
    options.heartbeatTimeout =
        std::chrono::milliseconds(static_cast<int64_t>(leaseSeconds * 1000));
    options.rendezvousTimeout = std::chrono::milliseconds(
        static_cast<int64_t>(rendezvousSeconds * 1000));
    group = std::make_unique<Group>(
        store,
        rpc::WorkerInfo(name, static_cast<int64_t>(rank)),
        worldSize,
        options,
        listener);
  }
  const std::string name;
  AgentOptions options;
  RecordingListener listener;
  std::unique_ptr<Group> group;
};

rpc::RRefId rrefId(const std::pair<int, int64_t>& id) {
  return rpc::RRefId(static_cast<rpc::worker_id_t>(id.first), id.second);
}

} // namespace

void bindTestingAgent(py::module_& parent) {
  auto m = parent.def_submodule("agent", "the agent's parts, driven alone");

  // Without the GIL: its destructor joins the group's watcher thread, which
  // may be in a call to a Store written in Python (that takes the GIL).
  py::class_<GroupHarness>(
      m, "Group", py::release_gil_before_calling_cpp_dtor())
      .def(
          py::init<
              const c10::intrusive_ptr<::c10d::Store>&,
              const std::string&,
              int,
              int,
              double,
              bool,
              const std::string&,
              double>(),
          py::arg("store"),
          py::arg("name"),
          py::arg("rank"),
          py::arg("world_size"),
          py::arg("lease_s") = 1.0,
          py::arg("answers_probes") = false,
          py::arg("secret") = "",
          py::arg("rendezvous_s") = 30.0)
      // Establish the secret and join with `offers` as the entry's body;
      // returns the secret (what every handshake proves).
      .def(
          "join",
          [](GroupHarness& h, const std::string& offers) {
            std::string secret;
            {
              py::gil_scoped_release nogil;
              secret = h.group->establishSecret();
              h.group->join(h.name + "\n" + offers, std::chrono::seconds(0));
            }
            return py::bytes(secret);
          },
          py::arg("offers") = "")
      .def_property_readonly(
          "incarnation",
          [](const GroupHarness& h) { return h.group->incarnation(); })
      .def_property_readonly(
          "epoch", [](const GroupHarness& h) { return h.group->view()->epoch; })
      // [(rank, name, incarnation, address)] of the current view.
      .def(
          "members",
          [](const GroupHarness& h) {
            std::vector<std::tuple<int64_t, std::string, uint64_t, std::string>>
                out;
            auto v = h.group->view();
            for (const auto& p : v->byId) {
              if (p) {
                out.emplace_back(
                    p->info.id_,
                    p->info.name_,
                    p->incarnation,
                    p->route.address);
              }
            }
            return out;
          })
      .def(
          "worker",
          [](const GroupHarness& h, const std::string& name) {
            return h.group->worker(name).id_;
          })
      .def(
          "barrier",
          [](GroupHarness& h, int64_t value) {
            py::gil_scoped_release nogil;
            return h.group->barrier(value, std::nullopt, 0);
          })
      .def(
          "admission_error",
          [](const GroupHarness& h, int32_t id, uint64_t incarnation) {
            return h.group->admissionError(id, incarnation);
          })
      // Membership events, waiting up to `timeout` s; None once stopped.
      .def(
          "events",
          [](GroupHarness& h, double timeout) -> py::object {
            std::optional<std::vector<MembershipEvent>> evs;
            {
              py::gil_scoped_release nogil;
              evs = h.group->takeEvents(
                  std::chrono::milliseconds(
                      static_cast<int64_t>(timeout * 1000)));
            }
            if (!evs) {
              return py::none();
            }
            py::list out;
            for (const auto& ev : *evs) {
              out.append(eventTuple(ev));
            }
            return out;
          })
      .def(
          "leave",
          [](GroupHarness& h) {
            py::gil_scoped_release nogil;
            h.group->leave(std::nullopt);
          })
      .def(
          "stop",
          [](GroupHarness& h) {
            py::gil_scoped_release nogil;
            h.group->stop();
          })
      // Its watcher stopped, not leaving: listed, silent (a stopped process).
      .def(
          "freeze",
          [](GroupHarness& h) {
            py::gil_scoped_release nogil;
            h.group->stopWatcher();
          })
      // Group::addMetrics' rpc_ext.membership.* (dynamic groups).
      .def(
          "metrics",
          [](const GroupHarness& h) {
            std::unordered_map<std::string, std::string> m;
            h.group->addMetrics(m);
            return m;
          })
      // And continued.
      .def(
          "thaw",
          [](GroupHarness& h) {
            py::gil_scoped_release nogil;
            h.group->startWatcher();
          })
      .def_property_readonly(
          "fenced",
          [](const GroupHarness& h) {
            return h.group->fenced() ? h.group->fencedReason() : std::string();
          })
      // What the listener heard.
      .def(
          "departed",
          [](GroupHarness& h) {
            std::lock_guard<std::mutex> lock(h.listener.mutex_);
            return h.listener.departed_;
          })
      .def(
          "probes",
          [](GroupHarness& h) {
            std::lock_guard<std::mutex> lock(h.listener.mutex_);
            return h.listener.probes_;
          })
      .def(
          "fenced_reason_heard",
          [](GroupHarness& h) {
            std::lock_guard<std::mutex> lock(h.listener.mutex_);
            return h.listener.fenced_;
          })
      .def(
          "reserved",
          [](GroupHarness& h) {
            std::lock_guard<std::mutex> lock(h.listener.mutex_);
            return h.listener.reserved_;
          })
      // (peers ever seen, distinct statistics objects among them).
      .def("peer_records", [](const GroupHarness& h) {
        const auto all = h.group->everyPeer();
        std::set<const PeerStats*> stats;
        for (const auto& p : all) {
          stats.insert(&p->stats);
        }
        return std::make_pair(all.size(), stats.size());
      });

  // The RRef guard's fork attribution. RRef and fork ids are
  // (worker id, local id) pairs.
  py::class_<RRefGuard>(m, "RRefGuard")
      .def(py::init([](int self) {
        return std::make_unique<RRefGuard>(
            static_cast<rpc::worker_id_t>(self),
            "worker" + std::to_string(self),
            /*dynamicGroup=*/true,
            [](std::function<void()> task) { task(); });
      }))
      // A fork request from `holder` served (or, `delete`, a user
      // deletion). (Parsing the request needs a running agent: the
      // attribution rule is what is driven here.)
      .def(
          "serve",
          [](RRefGuard& g,
             std::pair<int, int64_t> fork,
             int holder,
             bool deletion) {
            if (deletion) {
              g.forkDeleted(rrefId(fork));
            } else {
              g.forkRegistered(
                  rrefId(fork), static_cast<rpc::worker_id_t>(holder));
            }
          },
          py::arg("fork"),
          py::arg("holder") = -1,
          py::arg("delete") = false)
      .def("holder_of", [](const RRefGuard& g, std::pair<int, int64_t> fork) {
        return static_cast<int>(g.holderOf(rrefId(fork)));
      });

  // The table of requests being served, its tickets by request id (no
  // caller: None in what it lists).
  struct ServingTableForTesting {
    ServingTable table;
    std::unordered_map<int64_t, ServingTable::Ticket> tickets;
  };
  auto stageNamed = [](const std::string& name) {
    for (auto s :
         {ServingTable::Stage::kQueued,
          ServingTable::Stage::kRunning,
          ServingTable::Stage::kWaiting,
          ServingTable::Stage::kResponding}) {
      if (name == ServingTable::stageName(s)) {
        return s;
      }
    }
    throw py::value_error("no stage named " + name);
  };
  auto ticketOf = [](ServingTableForTesting& t, int64_t id) {
    auto it = t.tickets.find(id);
    if (it == t.tickets.end()) {
      throw py::key_error("no request " + std::to_string(id) + " is served");
    }
    return it->second;
  };
  py::class_<ServingTableForTesting>(m, "ServingTable")
      .def(py::init<>())
      .def(
          "add",
          [](ServingTableForTesting& t, int64_t id) {
            if (t.tickets.count(id) != 0) {
              throw py::value_error("request " + std::to_string(id) + " twice");
            }
            t.tickets[id] = t.table.add(id, nullptr, CallKind::kPython).first;
          })
      .def(
          "enter",
          [=](ServingTableForTesting& t, int64_t id, const std::string& stage) {
            ServingTable::enter(ticketOf(t, id), stageNamed(stage));
          })
      .def(
          "leave_running",
          [=](ServingTableForTesting& t, int64_t id) {
            ServingTable::leaveRunning(ticketOf(t, id));
          })
      .def(
          "remove",
          [=](ServingTableForTesting& t, int64_t id) {
            t.table.remove(ticketOf(t, id));
            t.tickets.erase(id);
          })
      // ([(id, stage, thread)], how many in all), oldest first.
      .def("oldest", [](const ServingTableForTesting& t, size_t limit) {
        auto [oldest, total] = t.table.oldest(limit);
        std::vector<std::tuple<int64_t, std::string, int32_t>> out;
        for (const auto& r : oldest) {
          out.emplace_back(r.id, ServingTable::stageName(r.stage), r.thread);
        }
        return std::make_pair(std::move(out), total);
      });

  // What a request's entry costs (docs/performance.md, "Requests being
  // served"): `threads` threads at once each serve `requests` through one
  // table as the server does (add, running, responding, remove); the wall
  // time in nanoseconds per request of one thread, and how many entries
  // the table holds after (0 unless an entry was lost).
  m.def(
      "serving_table_cost",
      [](int64_t requests, int threads) {
        ServingTable table;
        auto one = [&table, requests](int64_t base) {
          for (int64_t i = 0; i < requests; ++i) {
            auto ticket = table.add(base + i, nullptr, CallKind::kPython).first;
            ServingTable::enter(ticket, ServingTable::Stage::kRunning);
            ServingTable::enter(ticket, ServingTable::Stage::kResponding);
            table.remove(ticket);
          }
        };
        threads = std::clamp(threads, 1, 64);
        const auto start = std::chrono::steady_clock::now();
        std::vector<std::thread> running;
        for (int t = 0; t < threads; ++t) {
          running.emplace_back(one, static_cast<int64_t>(t) * requests);
        }
        for (auto& t : running) {
          t.join();
        }
        const auto ns = std::chrono::duration<double, std::nano>(
                            std::chrono::steady_clock::now() - start)
                            .count();
        return std::make_pair(
            ns / static_cast<double>(std::max<int64_t>(1, requests)),
            table.size());
      },
      py::arg("requests"),
      py::arg("threads") = 1,
      py::call_guard<py::gil_scoped_release>());

  // A handler that blocks `transport`'s loop of this process's current
  // agent for `seconds` (the health probes' test): false without such an
  // agent or transport.
  m.def(
      "stall_loop",
      [](const std::string& transport, double seconds) {
        if (!rpc::RpcAgent::isCurrentRpcAgentSet()) {
          return false;
        }
        auto agent = std::dynamic_pointer_cast<Agent>(
            rpc::RpcAgent::getCurrentRpcAgent());
        seconds = std::isnan(seconds) ? 0.0 : std::clamp(seconds, 0.0, 600.0);
        return agent != nullptr &&
            agent->stallLoopForTesting(
                transport,
                std::chrono::milliseconds(
                    static_cast<int64_t>(seconds * 1000)));
      },
      py::arg("transport"),
      py::arg("seconds"),
      py::call_guard<py::gil_scoped_release>());

  // The live agent's group secret (what its handshakes prove; a dynamic
  // group's is made in the store, not the user's passphrase): None without
  // an agent of ours.
  m.def("group_secret", []() -> py::object {
    if (!rpc::RpcAgent::isCurrentRpcAgentSet()) {
      return py::none();
    }
    auto agent =
        std::dynamic_pointer_cast<Agent>(rpc::RpcAgent::getCurrentRpcAgent());
    if (agent == nullptr) {
      return py::none();
    }
    return py::bytes(agent->groupSecretForTesting());
  });

  // forksCarried(): which of `forks` [(rref, fork)] the payload carries.
  m.def(
      "forks_carried",
      [](const py::bytes& payload,
         int self,
         const std::vector<
             std::pair<std::pair<int, int64_t>, std::pair<int, int64_t>>>&
             forks) {
        std::vector<std::pair<rpc::RRefId, rpc::ForkId>> in;
        for (const auto& [r, f] : forks) {
          in.emplace_back(rrefId(r), rrefId(f));
        }
        std::vector<std::pair<int, int64_t>> out;
        for (const auto& f : forksCarried(
                 std::string(payload),
                 static_cast<rpc::worker_id_t>(self),
                 in)) {
          out.emplace_back(f.createdOn_, f.localId_);
        }
        return out;
      });
}

} // namespace torch_rpc_ext::bindings
