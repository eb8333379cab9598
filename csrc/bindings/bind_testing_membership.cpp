// SPDX-License-Identifier: BSD-3-Clause
// torch_rpc_ext._testing (testing_module.cpp): the membership log of a
// dynamic group (csrc/agent/membership.h), its rules and its keys in a
// store, without an agent. For tests only.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "csrc/agent/membership.h"
#include "csrc/bindings/bind.h"

namespace torch_rpc_ext::bindings {

py::tuple eventTuple(const MembershipEvent& ev) {
  return py::make_tuple(
      eventKindName(ev.kind),
      ev.epoch,
      ev.member.name,
      ev.member.rank,
      ev.reason);
}

void bindTestingMembership(py::module_& m) {
  // The membership log's rules (agent/membership.h), without an agent.
  py::class_<Roster>(m, "Roster")
      .def(py::init<>())
      .def(
          "apply",
          [](Roster& r, const py::bytes& record) {
            return eventTuple(r.apply(std::string(record)));
          })
      .def_property_readonly("epoch", &Roster::epoch)
      .def("snapshot", [](const Roster& r) { return py::bytes(r.snapshot()); })
      .def(
          "restore",
          [](Roster& r, int64_t epoch, const py::bytes& text) {
            return r.restore(epoch, std::string(text));
          })
      .def("members", [](const Roster& r) {
        std::vector<std::pair<int32_t, std::string>> out;
        for (const auto& [rank, m] : r.members()) {
          out.emplace_back(rank, m.name);
        }
        return out;
      });
  m.def(
      "join_record",
      [](int32_t rank,
         const std::string& name,
         uint64_t incarnation,
         int64_t leaseMs,
         const std::string& offers) {
        Member mb;
        mb.rank = rank;
        mb.name = name;
        mb.incarnation = incarnation;
        mb.leaseMs = leaseMs;
        mb.offers = offers; // the rules read only its device lines
        return py::bytes(joinRecord(mb));
      },
      py::arg("rank"),
      py::arg("name"),
      py::arg("incarnation"),
      py::arg("lease_ms"),
      py::arg("offers") = "");
  m.def("leave_record", [](uint64_t incarnation) {
    return py::bytes(leaveRecord(incarnation));
  });
  m.def(
      "dead_record",
      [](uint64_t incarnation, uint64_t reporter, const std::string& reason) {
        return py::bytes(deadRecord(incarnation, reporter, reason));
      });
  // Append to the log in `store` (under `prefix`: "e0/" for the first
  // secret a group made) at the first free epoch after `after`, with the
  // proof of `secret` (bare without one, as a forger writes).
  m.def(
      "log_append",
      [](const c10::intrusive_ptr<::c10d::Store>& store,
         const py::bytes& record,
         int64_t after,
         const py::bytes& secret,
         const std::string& prefix) {
        std::string rec(record), key(secret);
        py::gil_scoped_release nogil;
        return MembershipLog(store, key, prefix).append(rec, after);
      },
      py::arg("store"),
      py::arg("record"),
      py::arg("after"),
      py::arg("secret") = py::bytes(),
      py::arg("prefix") = "");
  // Write `text` as the roster's snapshot at `epoch` and move the pointer
  // (MembershipLog::writeSnapshot), as a member reaching `epoch` does.
  m.def(
      "log_write_snapshot",
      [](const c10::intrusive_ptr<::c10d::Store>& store,
         int64_t epoch,
         const std::string& text,
         const py::bytes& secret,
         const std::string& prefix) {
        std::string key(secret);
        py::gil_scoped_release nogil;
        MembershipLog(store, key, prefix).writeSnapshot(epoch, text);
      },
      py::arg("store"),
      py::arg("epoch"),
      py::arg("text"),
      py::arg("secret") = py::bytes(),
      py::arg("prefix") = "");
  // The record at `epoch` in `store`, as (body, proven under `secret`), or
  // None.
  m.def(
      "log_read",
      [](const c10::intrusive_ptr<::c10d::Store>& store,
         int64_t epoch,
         const py::bytes& secret,
         const std::string& prefix) -> py::object {
        std::string key(secret);
        std::optional<LogRecord> r;
        {
          py::gil_scoped_release nogil;
          r = MembershipLog(store, key, prefix).read(epoch);
        }
        if (!r) {
          return py::none();
        }
        return py::make_tuple(py::bytes(r->body), r->proven);
      },
      py::arg("store"),
      py::arg("epoch"),
      py::arg("secret") = py::bytes(),
      py::arg("prefix") = "");
  // The epoch `incarnation` last acknowledged in `store` (0: none).
  m.def(
      "log_acked",
      [](const c10::intrusive_ptr<::c10d::Store>& store, uint64_t incarnation) {
        py::gil_scoped_release nogil;
        return MembershipLog(store).acked(incarnation);
      });
}

} // namespace torch_rpc_ext::bindings
