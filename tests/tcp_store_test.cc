// The TCP rendezvous store trusts nobody (device/host/tcp_store.cc): it listens on MASTER_ADDR's
// address only, answers only clients that present the job's id, never blocks on a client that
// stops reading, bounds what it holds, drops garbage without failing the job, and refuses a
// second process claiming a key another holds (two jobs on one port).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "zinf/comm.h"

namespace zinf {
namespace {

using std::chrono::milliseconds;

// A port nobody listens on now (bound, read, released).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) close(fd);
    return 0;
  }
  close(fd);
  return ntohs(a.sin_port);
}

TcpStoreOptions Options(int port, const std::string& job, bool serve) {
  TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.serve = serve;
  o.timeout = milliseconds(20000);
  o.job_id = job;
  o.max_clients = 8;
  return o;
}

// A raw connection to `ip`:port, or -1.
int Dial(const char* ip, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, ip, &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void Send(int fd, const std::string& bytes) {
  ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
}

std::string Field(const std::string& f) {
  const uint32_t n = static_cast<uint32_t>(f.size());
  return std::string(reinterpret_cast<const char*>(&n), sizeof(n)) + f;
}

std::string Hello(const std::string& job) { return std::string("ZINFKV02", 8) + Field(job); }
std::string GetRequest(const std::string& key) { return std::string(1, '\2') + Field(key); }

// Everything the server sends until it closes the connection (or 20 s pass: then "TIMEOUT").
std::string ReadToEnd(int fd) {
  std::string all;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    char buf[4096];
    const ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r <= 0) return all;
    all.append(buf, static_cast<size_t>(r));
  }
  return all + "TIMEOUT";
}

TEST(TcpStore, ServesItsJob) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  auto server = NewTcpStore(Options(port, "job-a", true));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto client = NewTcpStore(Options(port, "job-a", false));
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->Set("k", std::string("v\0w", 3)).ok());
  Result<std::string> v = (*server)->Get("k", milliseconds(5000));
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(*v, std::string("v\0w", 3));
  // The same value again is a harmless retry.
  EXPECT_TRUE((*client)->Set("k", std::string("v\0w", 3)).ok());
}

// It listened on every interface before: 127.0.0.2 (also loopback) reached it.
TEST(TcpStore, ListensOnMasterAddrOnly) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  auto server = NewTcpStore(Options(port, "job-a", true));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  const int other = Dial("127.0.0.2", port);
  EXPECT_LT(other, 0) << "the store answered on 127.0.0.2";
  if (other >= 0) close(other);
  const int mine = Dial("127.0.0.1", port);
  EXPECT_GE(mine, 0);
  if (mine >= 0) close(mine);
}

TEST(TcpStore, AnotherJobIsRefusedAndTold) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  auto server = NewTcpStore(Options(port, "job-a", true));
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->Set("zinf/member/1", "rank of job a").ok());
  auto stranger = NewTcpStore(Options(port, "job-b", false));
  ASSERT_TRUE(stranger.ok());
  const auto start = std::chrono::steady_clock::now();
  Status s = (*stranger)->Set("zinf/member/1", "rank of job b");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("belongs to another job"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("MASTER_PORT"), std::string::npos) << s.ToString();
  // Refused at once, not retried until the timeout (20 s).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  Result<std::string> got = (*stranger)->Get("zinf/member/1", milliseconds(1000));
  EXPECT_FALSE(got.ok());
  Result<std::string> kept = (*server)->Get("zinf/member/1", milliseconds(5000));
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(*kept, "rank of job a");
}

// Before: any process read rank 0's keys with the plain protocol.
TEST(TcpStore, AStrangerReadsNothing) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  auto server = NewTcpStore(Options(port, "secret", true));
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->Set("zinf/0", "rank 0's address").ok());
  // The old protocol's GET, no handshake: dropped without a byte.
  int fd = Dial("127.0.0.1", port);
  ASSERT_GE(fd, 0);
  Send(fd, GetRequest("zinf/0"));
  EXPECT_EQ(ReadToEnd(fd), "");
  close(fd);
  // A wrong job id: one status byte (another job's store), then closed; the GET after it is
  // never answered.
  fd = Dial("127.0.0.1", port);
  ASSERT_GE(fd, 0);
  Send(fd, Hello("guess") + GetRequest("zinf/0"));
  EXPECT_EQ(ReadToEnd(fd), std::string(1, '\2'));
  close(fd);
  // Garbage: dropped; the job's own client is served as before.
  fd = Dial("127.0.0.1", port);
  ASSERT_GE(fd, 0);
  Send(fd, std::string(5000, '\xff'));
  EXPECT_EQ(ReadToEnd(fd), "");
  close(fd);
  auto member = NewTcpStore(Options(port, "secret", false));
  ASSERT_TRUE(member.ok());
  Result<std::string> v = (*member)->Get("zinf/0", milliseconds(5000));
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(*v, "rank 0's address");
}

// Before: a client that sent requests and never read blocked the server thread in send(), and
// every rank's rendezvous with it.
TEST(TcpStore, AClientThatStopsReadingBlocksNobody) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  auto server = NewTcpStore(Options(port, "job", true));
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->Set("big", std::string(1 << 20, 'x')).ok());
  const int fd = Dial("127.0.0.1", port);
  ASSERT_GE(fd, 0);
  // 64 GETs of 1 MiB, never read: far more than the socket buffers hold.
  std::string requests = Hello("job");
  for (int i = 0; i < 64; ++i) requests += GetRequest("big");
  Send(fd, requests);
  auto member = NewTcpStore(Options(port, "job", false));
  ASSERT_TRUE(member.ok());
  EXPECT_TRUE((*member)->Set("after", "1").ok());
  Result<std::string> v = (*member)->Get("big", milliseconds(20000));
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->size(), size_t{1} << 20);
  // The silent client was dropped once its unread replies passed the bound: the connection
  // ends after at most that many bytes.
  std::string got = ReadToEnd(fd);
  EXPECT_EQ(got.find("TIMEOUT"), std::string::npos);
  EXPECT_LT(got.size(), size_t{64} << 20);
  close(fd);
}

// Before: 1,500 keys of 1 MiB grew rank 0 by 1.5 GB.
TEST(TcpStore, WhatItHoldsIsBounded) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  auto server = NewTcpStore(Options(port, "job", true));
  ASSERT_TRUE(server.ok());
  const std::string mib(1 << 20, 'x');
  int stored = 0;
  Status last;
  for (int i = 0; i < 100 && last.ok(); ++i) {
    last = (*server)->Set("k" + std::to_string(i), mib);
    if (last.ok()) ++stored;
  }
  EXPECT_EQ(stored, 63);  // 64 MiB in all, keys included
  EXPECT_EQ(last.code(), StatusCode::kResourceExhausted) << last.ToString();
  EXPECT_NE(last.message().find("full"), std::string::npos) << last.ToString();
  // A key over 4 KiB or a value over 1 MiB is refused by the client; a raw one over the
  // bound is dropped by the server.
  EXPECT_EQ((*server)->Set(std::string(5000, 'k'), "v").code(), StatusCode::kInvalidArgument);
  const int fd = Dial("127.0.0.1", port);
  ASSERT_GE(fd, 0);
  const uint32_t huge = 1u << 30;
  Send(fd, Hello("job") + std::string(1, '\1') + Field("k") +
               std::string(reinterpret_cast<const char*>(&huge), 4));
  EXPECT_EQ(ReadToEnd(fd), std::string(1, '\1'));  // the handshake's ok, then dropped
  close(fd);
}

// Two processes claiming one rank (two jobs on one port without job ids): the second is
// refused, naming why.
TEST(TcpStore, KeysAreWrittenOnce) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  auto server = NewTcpStore(Options(port, "", true));
  ASSERT_TRUE(server.ok());
  auto a = NewTcpStore(Options(port, "", false));
  auto b = NewTcpStore(Options(port, "", false));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Set("zinf/member/1", "host 100").ok());
  Status s = (*b)->Set("zinf/member/1", "host 200");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("same rank"), std::string::npos) << s.ToString();
  Result<std::string> v = (*server)->Get("zinf/member/1", milliseconds(5000));
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, "host 100");
}

// A connection that never says hello is closed after the handshake window (10 s) and takes
// nothing from the others meanwhile.
TEST(TcpStore, ASilentStrangerIsClosed) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  auto server = NewTcpStore(Options(port, "job", true));
  ASSERT_TRUE(server.ok());
  const int fd = Dial("127.0.0.1", port);
  ASSERT_GE(fd, 0);
  auto member = NewTcpStore(Options(port, "job", false));
  ASSERT_TRUE(member.ok());
  EXPECT_TRUE((*member)->Set("k", "v").ok());
  EXPECT_EQ(ReadToEnd(fd), "");  // closed by the server, within ReadToEnd's 20 s
  close(fd);
}

// 100 connections that never say hello (over the bound of 64): the job's own client still
// gets in at once; before, it was closed unread until the strangers' 10 s window ran out.
TEST(TcpStore, AFloodOfSilentConnectionsKeepsNoRankOut) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  auto server = NewTcpStore(Options(port, "job", true));
  ASSERT_TRUE(server.ok());
  std::vector<int> flood;
  for (int i = 0; i < 100; ++i) {
    const int fd = Dial("127.0.0.1", port);
    if (fd >= 0) flood.push_back(fd);
  }
  EXPECT_EQ(flood.size(), 100u);
  TcpStoreOptions o = Options(port, "job", false);
  o.timeout = milliseconds(5000);  // half the strangers' window
  auto member = NewTcpStore(o);
  ASSERT_TRUE(member.ok());
  EXPECT_TRUE((*member)->Set("k", "v").ok());
  for (int fd : flood) close(fd);
}

TEST(TcpStore, ArgumentsAreChecked) {
  TcpStoreOptions o = Options(0, "", false);
  EXPECT_EQ(NewTcpStore(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(1234, std::string(300, 'j'), false);
  EXPECT_EQ(NewTcpStore(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(FreePort(), "", true);
  o.host = "192.0.2.1";  // TEST-NET-1: not an address of this machine; never contacted
  Result<std::shared_ptr<KeyValueStore>> s = NewTcpStore(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("ZINF_STORE_LISTEN_ADDR"), std::string::npos)
      << s.status().ToString();
}

}  // namespace
}  // namespace zinf
