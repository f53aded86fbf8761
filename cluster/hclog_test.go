package cluster

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/hashicorp/go-hclog"
)

func TestClusterHCLogAdapter(t *testing.T) {
	var buf bytes.Buffer
	l := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	h := NewHCLogger(l, "raft")

	h.Trace("hidden trace")
	h.Debug("dbg", "k", 1)
	h.Named("transport").With("peer", "n2").Warn("slow", "ms", 12)
	h.ResetNamed("other").Error("boom")
	h.SetLevel(hclog.Warn)
	h.Info("suppressed by SetLevel")

	out := buf.String()
	for _, want := range []string{
		`level=DEBUG msg=dbg logger=raft k=1`,
		`level=WARN msg=slow logger=raft.transport peer=n2 ms=12`,
		`level=ERROR msg=boom logger=other`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in:\n%s", want, out)
		}
	}
	for _, not := range []string{"hidden trace", "suppressed by SetLevel"} {
		if strings.Contains(out, not) {
			t.Errorf("unexpected %q in:\n%s", not, out)
		}
	}
	if h.IsTrace() || h.IsInfo() || !h.IsWarn() {
		t.Errorf("level guards: trace %v info %v warn %v", h.IsTrace(), h.IsInfo(), h.IsWarn())
	}
	if got := h.With("a", 1).ImpliedArgs(); len(got) != 2 {
		t.Errorf("implied args %v", got)
	}
	h.StandardLogger(&hclog.StandardLoggerOptions{ForceLevel: hclog.Error}).Print("std line")
	if !strings.Contains(buf.String(), "level=ERROR msg=\"std line\"") {
		t.Errorf("standard logger output missing:\n%s", buf.String())
	}
}

func TestClusterConfigDefaults(t *testing.T) {
	c, err := Config{NodeID: "a", RaftAddr: "127.0.0.1:7000", DataDir: t.TempDir()}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if c.HeartbeatTimeout.Seconds() != 1 || c.LeaderLeaseTimeout.Milliseconds() != 500 || c.CommitTimeout.Milliseconds() != 5 {
		t.Errorf("timeouts %v %v %v", c.HeartbeatTimeout, c.LeaderLeaseTimeout, c.CommitTimeout)
	}
	if c.AdvertiseAddr != "127.0.0.1:7000" {
		t.Errorf("advertise %q", c.AdvertiseAddr)
	}
	for _, bad := range []Config{
		{RaftAddr: "127.0.0.1:7000", DataDir: "d"},                                        // no id
		{NodeID: "a", RaftAddr: ":7000", DataDir: "d"},                                    // not advertisable
		{NodeID: "a", RaftAddr: "127.0.0.1:7000", DataDir: "d", Peers: []Peer{{ID: "a"}}}, // peer without addr
		{NodeID: "a", RaftAddr: "127.0.0.1:7000", DataDir: "d", LeaderLeaseTimeout: 5e9},  // lease > heartbeat
	} {
		if _, err := bad.withDefaults(); err == nil {
			t.Errorf("config %+v accepted", bad)
		}
	}
}
