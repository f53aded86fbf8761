// Package netaddr holds the one rule every secure default of kvrouter
// starts from: whether a listen address binds loopback only (then only
// this host can reach it, and a development setup may run without
// credentials).
package netaddr

import "net"

// LoopbackListen says whether a host:port listen address binds loopback
// only: "localhost" and loopback IPs count; ":port", 0.0.0.0, [::] and any
// other host do not.
func LoopbackListen(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
