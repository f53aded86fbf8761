package netaddr

import "testing"

func TestLoopbackListen(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:8001": true, "localhost:80": true, "[::1]:9": true, "127.5.6.7:1": true,
		":8001": false, "0.0.0.0:8001": false, "[::]:8001": false, "10.0.0.1:8001": false,
		"example.org:80": false, "127.0.0.1": false, "": false,
	} {
		if got := LoopbackListen(addr); got != want {
			t.Errorf("%q: %v, want %v", addr, got, want)
		}
	}
}
