// SPDX-License-Identifier: BSD-3-Clause
#include "csrc/transport/tcp/loop.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "csrc/common/logging.h"

namespace torch_rpc_ext::transport::tcp {

namespace {
[[noreturn]] void fail(const char* what) {
  throw std::runtime_error(std::string(what) + ": " + std::strerror(errno));
}

// Handlers must not throw; if one does anyway, the loop logs it and goes on
// rather than taking the whole process down with std::terminate.
template <typename F>
void runGuarded(F&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    logWarning(std::string("torch_rpc_ext: loop handler threw: ") + e.what());
  } catch (...) {
    logWarning("torch_rpc_ext: loop handler threw a non-exception");
  }
}
} // namespace

Loop::Loop() {
  epollFd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epollFd_ < 0) {
    fail("epoll_create1");
  }
  wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wakeFd_ < 0) {
    fail("eventfd");
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wakeFd_;
  if (::epoll_ctl(epollFd_, EPOLL_CTL_ADD, wakeFd_, &ev) != 0) {
    fail("epoll_ctl(eventfd)");
  }
  thread_ = std::thread([this] { run(); });
  threadId_ = thread_.get_id();
}

Loop::~Loop() {
  stop();
  ::close(wakeFd_);
  ::close(epollFd_);
}

void Loop::addFromLoop(int fd, std::shared_ptr<Pollable> p, uint32_t events) {
  handlers_[fd] = std::move(p);
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = fd;
  if (::epoll_ctl(epollFd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    handlers_.erase(fd);
    fail("epoll_ctl(ADD)");
  }
}

void Loop::modify(int fd, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.fd = fd;
  ::epoll_ctl(epollFd_, EPOLL_CTL_MOD, fd, &ev);
}

void Loop::removeFromLoop(int fd) {
  ::epoll_ctl(epollFd_, EPOLL_CTL_DEL, fd, nullptr);
  handlers_.erase(fd);
}

void Loop::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      return;
    }
    posted_.push_back(std::move(fn));
  }
  wake();
}

void Loop::runAfter(std::chrono::milliseconds delay, std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      return;
    }
    timers_.emplace(std::chrono::steady_clock::now() + delay, std::move(fn));
  }
  wake();
}

bool Loop::inLoop() const {
  return std::this_thread::get_id() == threadId_;
}

void Loop::wake() {
  uint64_t one = 1;
  ssize_t rv = ::write(wakeFd_, &one, sizeof(one));
  (void)rv;
}

void Loop::run() {
  constexpr int kMaxEvents = 64;
  epoll_event events[kMaxEvents];
  while (true) {
    int timeoutMs = -1;
    std::vector<std::function<void()>> work;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto now = std::chrono::steady_clock::now();
      while (!timers_.empty() && timers_.begin()->first <= now) {
        work.push_back(std::move(timers_.begin()->second));
        timers_.erase(timers_.begin());
      }
      if (!timers_.empty()) {
        auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(
            timers_.begin()->first - now);
        timeoutMs = static_cast<int>(wait.count()) + 1;
      }
      work.insert(
          work.end(),
          std::make_move_iterator(posted_.begin()),
          std::make_move_iterator(posted_.end()));
      posted_.clear();
      if (stopping_ && work.empty()) {
        break;
      }
    }
    for (auto& fn : work) {
      runGuarded(fn);
    }
    if (!work.empty()) {
      timeoutMs = 0; // new work may have been posted meanwhile
    }
    int n = ::epoll_wait(epollFd_, events, kMaxEvents, timeoutMs);
    if (n < 0 && errno != EINTR) {
      fail("epoll_wait");
    }
    for (int i = 0; i < n; ++i) {
      int fd = events[i].data.fd;
      if (fd == wakeFd_) {
        uint64_t drain;
        ssize_t rv = ::read(wakeFd_, &drain, sizeof(drain));
        (void)rv;
        continue;
      }
      auto it = handlers_.find(fd);
      if (it == handlers_.end()) {
        continue;
      }
      auto keep = it->second; // a handler may remove itself
      uint32_t ev = events[i].events;
      runGuarded([&] { keep->handleEventsFromLoop(ev); });
    }
  }
  handlers_.clear();
}

void Loop::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      return;
    }
    stopping_ = true;
    timers_.clear();
  }
  wake();
  if (thread_.joinable()) {
    if (inLoop()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
}

} // namespace torch_rpc_ext::transport::tcp
