module duality/bench/pullclient

go 1.22
